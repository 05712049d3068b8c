import sys

from proxy.cli import main

if __name__ == "__main__":  # not when a spawned process (the planner's) imports the parent's main module
    sys.exit(main())
