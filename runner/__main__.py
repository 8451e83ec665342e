from runner.app import run

run()
