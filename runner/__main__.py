from runner.app import main

main()
