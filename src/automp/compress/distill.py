"""Knowledge distillation: train a small student to match a trained teacher's outputs (and, optionally, layers).

    distiller = Distiller(student, teacher, DistillConfig(temperature=4.0, alpha=0.9))
    opt = torch.optim.Adam(distiller.trainable_parameters(), lr=1e-3)
    for x, y in data:
        logits = distiller(x)                          # teacher (eval, no grad) then student; the student's output
        loss = distiller.kd_loss(F.cross_entropy(logits, y))
        opt.zero_grad(); loss.backward(); opt.step()
    student = distiller.export()                       # the plain student: hooks removed, no teacher attached

Hinton et al. (2015): the teacher's softened distribution softmax(t/T) says which wrong classes look like the right
one, and that "dark knowledge" is most of what a student with little data or noisy labels lacks. The KL term is
multiplied by T^2 so its gradients keep the size of the hard-label loss's as T changes. Feature losses (FitNets)
match named intermediate layers through a learned linear projection when the widths differ.

Why a wrapper module, as in NVIDIA ModelOpt's KD: one call runs both models, so the training loop changes in two
lines and every tool that wraps "the model" (automp.enable, DDP, QAT on the student) sees one module. Under
automp the Distiller is the root: teacher and student run inside its call on the path automp picks for it (their
outputs and captured layers may come back in fp16/bf16), and kd_loss computes every term in float32 outside it.
Projections are applied functionally in kd_loss for the same reason: a module called outside the root would
become a second root of its own.

Parameters: `parameters()` keeps nn.Module's meaning (student, projections and the frozen teacher, whose
requires_grad is False, so an optimizer given them never updates it); `trainable_parameters()` is what an
optimizer needs (student + projections); `student_parameters()` is the student's alone.

QAT: prepare_qat(student) before wrapping it (the hooks hold the layers they were put on), train through the
Distiller, then convert_qat(distiller.export()).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# attributes that give a layer's output width, in the order tried (normalized_shape: its last entry)
_WIDTH_ATTRS = ("out_features", "out_channels", "embedding_dim", "num_features", "hidden_size", "normalized_shape")


@dataclass
class DistillConfig:
    """temperature: T of softmax(logits / T) on both sides (> 0); 1 is plain KL, 2-8 are usual.
    alpha: weight of the distillation term; the student's own loss gets 1 - alpha (kd_loss(None): KD only).
    balance: scale the distillation term to the student loss's magnitude (a detached factor) before weighting,
    so alpha means a share of the gradient rather than of two losses in unrelated units.
    features: (student layer, teacher layer) name pairs, as in named_modules(); their outputs are matched by MSE.
    feature_weight: weight of the summed feature losses inside the distillation term.
    feature_dim: the width axis of those outputs: -1 for [..., D] (Linear, transformer), 1 for NCHW conv maps.
    logits_fn: picks the logits from a model's output; default: the output if it is a tensor, else `.logits`."""
    temperature: float = 4.0
    alpha: float = 0.5
    balance: bool = False
    features: list[tuple[str, str]] = field(default_factory=list)
    feature_weight: float = 1.0
    feature_dim: int = -1
    logits_fn: Callable[[Any], Tensor] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha weighs KD against the student loss and must lie in [0, 1], got {self.alpha!r}")
        if not (math.isfinite(self.feature_weight) and self.feature_weight >= 0):
            raise ValueError(f"feature_weight must be >= 0, got {self.feature_weight!r}")
        for pair in self.features:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise TypeError(f"each entry of features must be a (student_layer, teacher_layer) pair of names, "
                                f"got {pair!r}")
        if not isinstance(self.feature_dim, int) or isinstance(self.feature_dim, bool):
            raise TypeError(f"feature_dim must be an int axis, got {self.feature_dim!r}")


def kd_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """KL(softmax(t/T) || softmax(s/T)) * T^2 over the last axis, mean over every other position, in float32."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    if student_logits.dim() < 1 or student_logits.shape[-1] < 2:
        raise ValueError(f"KD needs class logits [..., C] with C >= 2, got shape {tuple(student_logits.shape)}")
    c = student_logits.shape[-1]
    log_ps = F.log_softmax(student_logits.float().reshape(-1, c) / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits.float().reshape(-1, c) / temperature, dim=-1)
    return F.kl_div(log_ps, log_pt, reduction="batchmean", log_target=True) * temperature ** 2


class Distiller(nn.Module):
    """Student + frozen teacher in one module; forward returns the student's output, kd_loss the training loss.

    example_inputs: one batch (tuple of positional args) to run once when a feature pair's widths cannot be read
    from the layers' attributes (out_features, out_channels, ...); it is a real forward of both models."""

    def __init__(self, student: nn.Module, teacher: nn.Module, config: DistillConfig | None = None,
                 example_inputs: tuple | None = None) -> None:
        super().__init__()
        for what, m in (("student", student), ("teacher", teacher)):
            if not isinstance(m, nn.Module):
                raise TypeError(f"Distiller's {what} must be an nn.Module, got {type(m).__name__}")
        if student is teacher or {id(p) for p in student.parameters()} & {id(p) for p in teacher.parameters()}:
            raise ValueError("student and teacher share parameters: distillation needs two separate models "
                             "(copy.deepcopy the teacher first if the student starts from it)")
        self.config = config = config or DistillConfig()
        self.student, self.teacher = student, teacher
        teacher.requires_grad_(False)
        teacher.eval()
        self.projections = nn.ModuleDict()
        self._captured: dict[tuple[str, str], Tensor | None] = {}
        self._pending: tuple[Tensor, Tensor] | None = None
        self._exported = False
        self._handles = []
        layers = [(self._layer(student, s, "student"), self._layer(teacher, t, "teacher"))
                  for s, t in config.features]
        for (s_name, s_mod), (t_name, t_mod) in layers:
            self._captured[("student", s_name)] = self._captured[("teacher", t_name)] = None
            self._handles.append(s_mod.register_forward_hook(self._capture("student", s_name)))
            self._handles.append(t_mod.register_forward_hook(self._capture("teacher", t_name)))
        self.last_losses: dict[str, Tensor] = {}  # detached terms of the last kd_loss, for logging (no sync)
        if layers:
            self._build_projections(layers, example_inputs)

    # -- parameters -----------------------------------------------------------------------------------------------
    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """The student's and the projections' parameters that require grad: what the optimizer should get."""
        for p in list(self.student.parameters()) + list(self.projections.parameters()):
            if p.requires_grad:
                yield p

    def student_parameters(self) -> Iterator[nn.Parameter]:
        return self.student.parameters()

    def train(self, mode: bool = True) -> "Distiller":
        super().train(mode)
        self.teacher.eval()  # dropout / batch-norm updates in the teacher would make its targets noise
        return self

    # -- forward --------------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._exported:
            raise RuntimeError("this Distiller was exported: use the student export() returned")
        with torch.no_grad():
            t_out = self.teacher(*args, **kwargs)
        s_out = self.student(*args, **kwargs)
        s_logits, t_logits = self._logits(s_out, "student"), self._logits(t_out, "teacher")
        if s_logits.shape != t_logits.shape:
            raise ValueError(f"teacher and student outputs differ in shape: student {tuple(s_logits.shape)}, "
                             f"teacher {tuple(t_logits.shape)}; KD compares them class by class (same classes, "
                             f"same positions), or set DistillConfig.logits_fn to pick comparable logits")
        self._pending = (s_logits, t_logits)
        return s_out

    def kd_loss(self, student_loss: Tensor | None = None) -> Tensor:
        """The loss of the last forward: alpha * KD + (1 - alpha) * student_loss (KD alone when None). KD is the
        temperature KL of the logits plus feature_weight * the feature MSEs, all in float32."""
        if self._pending is None:
            raise RuntimeError("kd_loss() called before forward: call the distiller on a batch first (each "
                               "forward's teacher outputs are used once, then released)")
        if student_loss is not None and (not isinstance(student_loss, Tensor) or student_loss.numel() != 1):
            raise ValueError("student_loss must be a scalar tensor (the student's own loss, e.g. cross entropy "
                             "with the labels)")
        cfg = self.config
        s_logits, t_logits = self._pending
        terms = {"logits": kd_kl(s_logits, t_logits, cfg.temperature)}
        kd = terms["logits"]
        if cfg.features:
            feats = self._feature_loss()
            terms["features"] = feats
            kd = kd + cfg.feature_weight * feats
        self._pending = None
        self._release()
        if student_loss is None:
            loss = kd
        else:
            student_loss = student_loss.float().reshape(())
            if cfg.balance:  # a detached factor: rescales the KD term's gradients, adds none of its own
                kd = kd * (student_loss.detach().abs() / kd.detach().clamp_min(1e-12))
            loss = cfg.alpha * kd + (1.0 - cfg.alpha) * student_loss
            terms["student"] = student_loss
        self.last_losses = {k: v.detach() for k, v in terms.items()}
        return loss

    def export(self) -> nn.Module:
        """The plain student (hooks removed); the Distiller cannot run afterwards. A QAT student still needs
        convert_qat."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._release()
        self._pending, self._exported = None, True
        return self.student

    # -- helpers --------------------------------------------------------------------------------------------------
    def _release(self) -> None:
        """Drop the captured layers (and their graphs) but keep the keys: under automp's compiled path Dynamo
        guards on the dict's length, and a dict emptied and refilled every step would recompile the forward."""
        for k in self._captured:
            self._captured[k] = None

    def _logits(self, out: Any, who: str) -> Tensor:
        fn = self.config.logits_fn
        if fn is not None:
            out = fn(out)
        elif not isinstance(out, Tensor):
            out = out["logits"] if isinstance(out, dict) and "logits" in out else getattr(out, "logits", out)
        if not isinstance(out, Tensor):
            raise TypeError(f"the {who}'s output is a {type(out).__name__}, not logits: set "
                            f"DistillConfig.logits_fn to pick the logits tensor from it")
        return out

    @staticmethod
    def _layer(model: nn.Module, name: str, who: str) -> tuple[str, nn.Module]:
        modules = dict(model.named_modules())
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=5, cutoff=0.4)
            hint = f"; close names: {', '.join(close)}" if close else f"; its layers: {', '.join(list(modules)[1:12])}"
            raise ValueError(f"{who} has no layer named {name!r}{hint}")
        return name, modules[name]

    def _capture(self, who: str, name: str) -> Callable[..., None]:
        captured = self._captured

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, (tuple, list)):
                output = next((o for o in output if isinstance(o, Tensor)), None)
            if isinstance(output, Tensor):
                captured[(who, name)] = output
        return hook

    def _build_projections(self, layers: list, example_inputs: tuple | None) -> None:
        widths: dict[tuple[str, str], int] = {}
        if example_inputs is not None:
            if not isinstance(example_inputs, tuple):
                raise TypeError("example_inputs must be a tuple of the models' positional inputs")
            with torch.no_grad():
                self.teacher(*example_inputs)
                self.student(*example_inputs)
            widths = {k: v.shape[self.config.feature_dim] for k, v in self._captured.items() if v is not None}
            self._release()
        device = next(iter(self.student.parameters()), torch.empty(0)).device
        for i, ((s_name, s_mod), (t_name, t_mod)) in enumerate(layers):
            s_w = widths.get(("student", s_name)) or _width(s_mod, s_name, "student")
            t_w = widths.get(("teacher", t_name)) or _width(t_mod, t_name, "teacher")
            if s_w != t_w:  # FitNets' regressor; a plain linear map is enough to align widths
                self.projections[str(i)] = nn.Linear(s_w, t_w, device=device)

    def _feature_loss(self) -> Tensor:
        total = None
        dim = self.config.feature_dim
        for i, (s_name, t_name) in enumerate(self.config.features):
            s, t = self._captured.get(("student", s_name)), self._captured.get(("teacher", t_name))
            for who, name, v in (("student", s_name, s), ("teacher", t_name, t)):
                if v is None:
                    raise RuntimeError(f"{who} layer {name!r} did not run (or returned no tensor) in the last "
                                       f"forward; if it was replaced after the Distiller was built (prepare_qat), "
                                       f"prepare the student first, then wrap it")
            s, t = s.float(), t.float()
            proj = self.projections[str(i)] if str(i) in self.projections else None
            if proj is not None:
                if s.shape[dim] != proj.in_features:
                    raise ValueError(f"student layer {s_name!r} has width {s.shape[dim]} on axis {dim}, its "
                                     f"projection expects {proj.in_features}: check DistillConfig.feature_dim")
                s = F.linear(s.movedim(dim, -1), proj.weight.float(), proj.bias.float()).movedim(-1, dim)
            if s.shape != t.shape:
                raise ValueError(f"feature {s_name!r} -> {t_name!r}: student {tuple(s.shape)} and teacher "
                                 f"{tuple(t.shape)} differ beyond the width axis {dim}")
            loss = F.mse_loss(s, t)
            total = loss if total is None else total + loss
        return total


def _width(module: nn.Module, name: str, who: str) -> int:
    for attr in _WIDTH_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, (tuple, list)) and v:
            v = v[-1]
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise ValueError(f"cannot tell the output width of {who} layer {name!r} ({type(module).__name__}): name a "
                     f"layer with out_features / out_channels / ..., or pass example_inputs to the Distiller")
