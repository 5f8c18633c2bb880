"""The vLLM side of ``kvtier layout check``: kvtier's canonical mappings against vLLM 0.33.0's.

The kvtier binary embeds this file, ``vllm_canonical.py`` and the stand-ins of ``stubs/``,
writes them to a temporary folder and runs this script with a Python that has the test
harness's packages (``tests/python/requirements.txt``: numpy, pydantic, ...). stdin:
``{"vllm_src": dir, "layouts": [{"file", "text", "answers": {"<tp>": answer}}]}`` where an
answer is kvtier's ``{"ranks": [{"rank", "layers": [...]}]}`` for that TP size; stdout:
``{"compared": n, "differences": ["...", ...]}``. Exit status 3: vLLM's modules cannot be
imported with this Python (the reason on stderr); the check is then skipped, not failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    request = json.load(sys.stdin)
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "stubs"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import kvtier_placeholders

        kvtier_placeholders.install(kvtier_placeholders.VLLM_STAND_INS)
        sys.path.insert(0, request["vllm_src"])
        import vllm_canonical as vc
    except Exception as e:  # noqa: BLE001 (any import failure means "cannot run here")
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 3
    compared, differences = 0, []
    for layout in request["layouts"]:
        model = vc.Model(Path(layout["file"]), layout["text"])
        for tp, answer in sorted(layout["answers"].items(), key=lambda kv: int(kv[0])):
            n, diffs = vc.compare(model, int(tp), answer)
            compared += n
            differences += diffs
    json.dump({"compared": compared, "differences": differences}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
