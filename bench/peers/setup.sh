#!/usr/bin/env bash
# The venv of B9's peer (bench/peer_trl.py): TRL in bench/peers/.venv, apart from the project's .venv.
#   bash bench/peers/setup.sh
# Every version comes from constraints/lock.txt, the lock the project's .venv is installed from, so
# both venvs run one transformers. torch first, pinned to the CPU build (as `make install` does):
# nothing can pull a CUDA torch.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$here/.venv"
lock="$repo/constraints/lock.txt"
torch="$(sed -n 's/^torch==//p' "$repo/constraints/cpu.txt")"
test -x "$venv/bin/python" || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check install -q -c "$repo/constraints/cpu.txt" -c "$lock")
"${pip[@]}" "torch==$torch"
"${pip[@]}" -r "$here/requirements.txt"
LOCK="$lock" "$venv/bin/python" - <<'PY'
import os, re
import accelerate, datasets, torch, transformers, trl
assert torch.version.cuda is None, f"a CUDA build of torch got in: {torch.__version__} (cuda {torch.version.cuda})"
pins = dict(re.findall(r"^([\w.-]+)==(\S+)", open(os.environ["LOCK"]).read(), re.M))
for mod in (accelerate, datasets, transformers, trl):
    assert mod.__version__ == pins[mod.__name__], f"{mod.__name__} {mod.__version__}, the lock says {pins[mod.__name__]}"
print(f"bench/peers/.venv: torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}, "
      f"trl {trl.__version__}, accelerate {accelerate.__version__}, datasets {datasets.__version__}")
PY
