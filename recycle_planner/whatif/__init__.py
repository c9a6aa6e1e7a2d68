"""What-if evaluation: training throughput over a failure trace for re-routing with the plan
library and for the strategies it competes with (checkpoint-restart with and without spares,
dropping pipelines, Oobleck-style and Bamboo-style recovery). See docs/whatif.md."""
