import collections, sys, time, torch
import automp
from automp.bench.suites import train as T
from torch.profiler import profile, ProfilerActivity

dev = "cuda"
def prof(mode, enable_kw=None, steps=3):
    torch.manual_seed(0); torch._dynamo.reset()
    model, batch, loss_of = T.MODELS["resnet50"](False, dev)
    step = T._step_fn(mode, model, batch, loss_of, dev)
    if enable_kw is not None:
        automp.enable(**enable_kw)
    ms, _ = T._time_steps(step, 3, 10, dev)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rep = automp.disable() if enable_kw is not None else None
    print(f"==== {mode} {enable_kw} {ms:.2f} ms/step")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    return rep

rep = prof("automp-bf16", dict(dtype="bf16"))
c = collections.Counter()
for g in rep["graphs"]:
    for n in g["nodes"]:
        if n["dtype"] == "float32":
            c[(g["kind"], n["op"], n["reason"][:60])] += 1
for k, v in c.most_common(25):
    print(v, k)
print({g["name"]: g["casts"] for g in rep["graphs"]})
prof("autocast-bf16+compile")
r16 = prof("automp-fp16", dict(dtype="fp16"))
print(r16["loss_scale"])
prof("automp-fp16", dict(dtype="fp16", loss_scale="off"))
