from runner.cli.app import run

run()
