#!/usr/bin/env bash
# The venv of B9's peer (bench/peer_trl.py): TRL in bench/peers/.venv, apart from the project's .venv.
#   bash bench/peers/setup.sh        # needs .venv (make install): the peer takes its transformers version
# torch first, pinned to the CPU build that lies on this machine's disk (as `make install` does), then the
# transformers of .venv, then requirements.txt constrained to both: nothing can pull a CUDA torch.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$here/.venv"
main="$repo/.venv/bin/python"
test -x "$main" || { echo "no $repo/.venv: run 'make install' first (the peer uses its transformers version)" >&2; exit 1; }
transformers="$("$main" -m pip show transformers | sed -n 's/^Version: //p')"
torch="$(sed -n 's/^torch==//p' "$repo/constraints/cpu.txt")"
test -x "$venv/bin/python" || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check install -q)
"${pip[@]}" -c "$repo/constraints/cpu.txt" "torch==$torch"
pins="$venv/pins.txt"
printf 'torch==%s\ntransformers==%s\n' "$torch" "$transformers" > "$pins"
"${pip[@]}" -c "$pins" "transformers==$transformers"
"${pip[@]}" -c "$pins" -r "$here/requirements.txt"
"$venv/bin/python" - <<'PY'
import accelerate, datasets, torch, transformers, trl
assert torch.version.cuda is None, f"a CUDA build of torch got in: {torch.__version__} (cuda {torch.version.cuda})"
print(f"bench/peers/.venv: torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}, "
      f"trl {trl.__version__}, accelerate {accelerate.__version__}, datasets {datasets.__version__}")
PY
