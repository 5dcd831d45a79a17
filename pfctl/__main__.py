"""`python -m pfctl` (also what `accelerate launch -m pfctl` and `torchrun -m pfctl` run)."""

from pfctl.cli.app import main

if __name__ == "__main__":
    main()
