"""Views for people: the CLI's plan summary, text timelines, Gantt charts and library reports
(figures are written headless and atomically)."""
