# Diagnostic: the detector interleaved with hand-written autocast-bf16 eager, automp forced onto each eager
# path (AUTOMP_PATH), so its layout and cuDNN trials run without the compiled candidates (whose compile alone ran past
# a 10-minute call). Run from the repository root: bash scripts/detector_layout.sh
for p in fp32 eager; do
AUTOMP_PATH=$p PYTHONPATH=src python3 - <<'PY' 2>&1 | grep -v -i warn | grep -v unbacked
import os, torch, json
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
from automp.bench.suites import zoo_interleave as zi
r = zi.interleaved("detector", False, "cuda", 10, 3, 200, anchor_mode="autocast-bf16-eager")
import automp
print("PATH", os.environ["AUTOMP_PATH"], json.dumps({k: v for k, v in r.items()}))
PY
done
