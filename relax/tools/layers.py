"""`relax compare --layers`: the report on where layer dumps part (relax/debug/layers.py judges them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from relax.debug.layers import compare_runs
from relax.errors import ConfigError, ReplayError
from relax.tools.plots import draw, plot_layers


def compare_layers(args, folder: Path | None, note: str | None) -> int:
    """`--layers`: the first module, gradient and weight where each job departs from the baseline."""
    try:
        departures, what = compare_runs(args.paths, args.baseline, args.rollout_id, args.layer_eps_multiple,
                                        args.envelope_margin)
    except (ConfigError, ReplayError, ValueError) as e:
        print(f"relax compare: error: {e}", file=sys.stderr)
        return 2
    plot = draw(plot_layers, departures, folder, "compare_layers.png")
    if args.json:
        print(json.dumps({"compared": what, "plot": plot and str(plot), "note": note, "jobs": [
            {"job": d.job, "departs": d.departs, "first": d.first, "spreads": d.spreads, "diffs": d.diffs,
             "floors": d.floors, "note": d.note} for d in departures]}))
    else:
        print(f"relax compare --layers ({what})")
        for d in departures:
            print(d.line())
        print(f"plot: {plot}" if plot else note)
    return 1 if any(d.departs for d in departures) else 0
