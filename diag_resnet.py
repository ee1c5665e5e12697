import collections, re, torch
import automp
from automp.bench.suites import train as T
from torch.profiler import profile, ProfilerActivity

dev = "cuda"
def prof(model_name, mode, steps=3):
    torch.manual_seed(0); torch._dynamo.reset()
    model, batch, loss_of = T.MODELS[model_name](False, dev)
    step = T._step_fn(mode, model, batch, loss_of, dev)
    if mode.startswith("automp"):
        automp.enable(dtype="fp16" if "fp16" in mode else "bf16")
    ms, _ = T._time_steps(step, 3, 15, dev)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rep = automp.disable() if mode.startswith("automp") else None
    kern = collections.Counter(); t = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = re.sub(r"_\d+$", "", e.name[:60])
            kern[name] += 1; t[name] += e.device_time
    total = sum(t.values()) / steps / 1e3
    print(f"== {model_name} {mode}: {ms:.2f} ms/step, GPU busy {total:.2f} ms/step, {sum(kern.values())//steps} kernels/step")
    return kern, t, rep

for name, a, b in (("resnet50", "autocast-bf16+compile", "automp-bf16"),):
    ka, ta, _ = prof(name, a)
    kb, tb, rep = prof(name, b)
    names = set(ta) | set(tb)
    diff = sorted(names, key=lambda n: -(abs(tb[n] - ta[n])))
    for n in diff[:25]:
        print(f"{(tb[n]-ta[n])/3/1e3:+8.3f} ms  {ka[n]//3:4d} -> {kb[n]//3:4d}  {n}")
    c = collections.Counter()
    for g in rep["graphs"]:
        for nd in g["nodes"]:
            if nd["dtype"] == "float32" and nd["op"] not in ("getitem",):
                c[(g["kind"], nd["op"])] += 1
    print(c.most_common(20))
    print({g["name"]: g["casts"] for g in rep["graphs"]})
prof("gpt124m", "automp-fp16")
prof("gpt124m", "automp-bf16")
