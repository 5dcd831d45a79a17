"""Worker for the data-parallel case of test_step_graphs: ``pfctl train`` in one of several processes (under
torchrun), its speed settled by hand on the CPU to the step's CUDA graphs (``step``, their recording played by
:func:`helpers.step_graphs.replaying_capture`) or to none (``plain``); eager blocks either way."""

from __future__ import annotations

import sys

from helpers.step_graphs import eager_speed, replaying_capture
from pfctl import api
from pfctl.config import load_config
from pfctl.training import trainer
from pfctl.training.step_graphs import StepGraphs


def main() -> int:
    recipe, graphs = sys.argv[1], "step" if sys.argv[2] == "step" else False
    StepGraphs.capture = replaying_capture
    trainer.resolve_train_speed = eager_speed(graphs, merged=False)
    api.train(load_config(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
