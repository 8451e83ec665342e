from runner.app import main
from runner.process import end_process

try:
    main()
except SystemExit as exc:  # bad input, a failed or interrupted run, Hydra's own exits
    end_process(exc.code)
end_process(0)
