"""Convert a run folder's pickled state.pt (branchspec before training state moved to
safetensors + JSON) into state.json + state-NNNNNN.safetensors, so `branchspec train --out
DIR --resume` continues it exactly.

    python scripts/migrate_train_state.py DIR

The file is read with torch.load(weights_only=True): PyTorch's restricted unpickler, which
builds tensors, numbers, strings and containers and refuses anything else, so a crafted
file cannot run code. Only run it on a folder you made. state.pt is left in place (rename
or delete it once the migrated run resumes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from branchspec.train.state import LEGACY_STATE, STATE_FILE, save_state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a run folder holding state.pt")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    path = folder / LEGACY_STATE
    if not path.is_file():
        parser.error(f"{path} does not exist")
    if (folder / STATE_FILE).exists():
        parser.error(f"{folder / STATE_FILE} exists already; nothing to migrate")
    try:
        st = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a refused type, a corrupt file
        parser.error(f"{path} cannot be read safely ({type(e).__name__}: {str(e)[:300]})")
    missing = [k for k in ("model", "optimizer", "sampler", "step", "history", "evals", "elapsed") if k not in st]
    if missing:
        parser.error(f"{path} lacks {missing}: not a branchspec training state")
    record = {k: st[k] for k in ("step", "sampler", "history", "evals", "elapsed")}
    record["sittings"] = st.get("sittings", [])
    save_state(folder, st["model"], st["optimizer"], record)
    print(f"wrote {folder / STATE_FILE} (step {record['step']}); resume with "
          f"`branchspec train --out {folder} --resume`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
