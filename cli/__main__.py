from recycle_planner.cli.main import main

main(prog_name="recycle-planner")
