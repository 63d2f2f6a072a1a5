"""Loss parallel's kernel: cross-entropy on logits sharded over the class dim, never gathered.

Each rank holds consecutive classes of every token's logits: ``C_local = C / world``,
classes ``[rank * C_local, (rank + 1) * C_local)``, or where the classes do not divide by the
world size, the ranks' ``torch.chunk`` of them (``classes=(offset, C)``; every rank holding
some). The loss needs per-token reductions over all
classes; each is one all-reduce of a per-token tensor in the compute dtype (fp32; fp64 for
fp64 logits):

1. the max logit (reduce op ``max``), which keeps the exponentials finite;
2. the sum of ``exp(logit - max)``;
3. the target terms, stacked per token: the target's shifted logit and, with label
   smoothing, the (weighted) sum of shifted logits; for probability targets the class sums
   ``sum_c w_c q_c`` and ``sum_c w_c q_c (logit_c - max)``.

The gradient, softmax times a per-token factor minus the (weighted) target distribution, is
computed locally from the saved per-token log-sum-exp: backward communicates nothing.
Temporaries are (tokens, C_local) buffers, so per-rank memory is about 1/world of the
unsharded loss.

Tokens sharded over ranks (logits split by rows, as a sequence-parallel head leaves them)
need no loss parallel: :func:`mean_of_token_shards` sums each rank's losses and the weight
of its kept targets, and one all-reduce of the two gives the mean.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import _all_reduce, all_reduce
from .local_ops import kept_target_weights
from .torch_compat import assert_async

REDUCTIONS = ("none", "mean", "sum")  # the order of aten's Reduction enum


def loss_parallel_cross_entropy(logits, target, weight, reduction: str, ignore_index: int,
                                label_smoothing: float, class_dim: int, rank: int, world: int,
                                group: str, classes=None) -> torch.Tensor:
    """:func:`cross_entropy` on a resolved group (``rank``, ``world`` and the registered
    ``group`` name): the form fxtp's graphs call. ``classes``: ``(offset, C)``, this rank's
    first class and the number of classes, where they are not ``world`` equal shards."""
    local = logits.shape[class_dim]
    offset, n_classes = classes or (rank * local, local * world)
    class_dim = _check(logits, target, weight, reduction, ignore_index, label_smoothing,
                       class_dim, n_classes)
    return _CrossEntropy.apply(logits, target, weight, reduction, ignore_index,
                               float(label_smoothing), class_dim, offset, n_classes, group)


def mean_of_token_shards(logits, target, weight, ignore_index: int, label_smoothing: float,
                         group: str) -> torch.Tensor:
    """``F.cross_entropy(..., reduction="mean")`` of all ranks' tokens, from this rank's
    ``logits`` and ``target`` (split alike along dim 0, classes whole): the sum of the
    losses over the total weight of the kept targets (for probability targets, the number
    of tokens), both summed over the ranks by one all-reduce (backward: none)."""
    total = F.cross_entropy(logits, target, weight, ignore_index=ignore_index,
                            reduction="sum", label_smoothing=label_smoothing)
    if target.is_floating_point():
        count = total.new_tensor(target.numel() // target.shape[1 if target.dim() > 1 else 0])
    else:
        count = kept_target_weights(target, weight, ignore_index, total.dtype).sum()
    summed = all_reduce(torch.stack([total, count.to(total.dtype)]), group)
    return summed[0] / summed[1]


def forward_all_reduce_bytes(tokens: int, dtype: torch.dtype, probability_targets: bool,
                             label_smoothing: float) -> list[int]:
    """Bytes per rank of the 3 all-reduces :func:`loss_parallel_cross_entropy` issues forward
    for ``tokens`` tokens of ``dtype`` logits (backward issues none): the per-token max, the
    per-token sum of exponentials and the stacked target terms (2 per token for probability
    targets; for class indices 1, 2 with label smoothing), in the compute dtype."""
    item = compute_dtype(dtype).itemsize
    terms = 2 if probability_targets else 1 + bool(label_smoothing)
    return [tokens * item, tokens * item, tokens * terms * item]


def _check(logits, target, weight, reduction, ignore_index, smoothing, class_dim,
           n_classes) -> int:
    """Validate the arguments as F.cross_entropy would; return the normalized class dim."""
    where = "fxtp.cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {smoothing}")
    if logits.dim() == 0 or not logits.is_floating_point():
        raise ValueError(f"{where}: logits must be a floating tensor with a class dim, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    n = logits.dim()
    if not -n <= class_dim < n:
        raise ValueError(f"{where}: class_dim={class_dim} is out of range for logits of shape "
                         f"{tuple(logits.shape)}")
    class_dim %= n
    tokens = logits.shape[:class_dim] + logits.shape[class_dim + 1:]
    if target.is_floating_point():
        if target.shape != logits.shape:
            raise ValueError(f"{where}: probability targets are sharded like the logits: "
                             f"pass this rank's slice of shape {tuple(logits.shape)}, got "
                             f"{tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError(f"{where}: ignore_index is not supported for probability targets")
    elif target.shape != tokens:
        hint = (" (for F.cross_entropy's (N, C, d1, ...) layout pass class_dim=1)"
                if n > 2 and class_dim != 1 else "")
        raise ValueError(f"{where}: class-index targets must have the logits' shape without "
                         f"class dim {class_dim}, {tuple(tokens)}; got {tuple(target.shape)}"
                         f"{hint}")
    else:
        bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
        assert_async(~bad.any(), f"{where}: a target is outside [0, {n_classes}) and "
                                        f"is not ignore_index={ignore_index}")
    if weight is not None:
        if weight.shape != (n_classes,):
            raise ValueError(f"{where}: weight must hold all {n_classes} classes (every rank "
                             f"passes the full tensor), got shape {tuple(weight.shape)}")
        if weight.requires_grad:
            raise ValueError(f"{where}: weight cannot require grad (F.cross_entropy is not "
                             f"differentiable with respect to it)")
    return class_dim


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-row sums over the classes are computed in: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _shifted(x: torch.Tensor, by: torch.Tensor, dtype) -> torch.Tensor:
    """A fresh contiguous ``x - by[..., None]`` in ``dtype`` (one (tokens, C_local) buffer)."""
    return x.to(dtype, memory_format=torch.contiguous_format, copy=True).sub_(by.unsqueeze(-1))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, reduction, ignore_index, smoothing, class_dim,
                offset, n_classes, group):
        x = logits.movedim(class_dim, -1)
        dtype = compute_dtype(logits.dtype)
        terms = _Terms(target, weight, ignore_index, smoothing, class_dim, offset, n_classes,
                       x.shape[-1], dtype)
        maxima = _all_reduce(x.amax(-1).to(dtype), group, "max")
        z = _shifted(x, maxima, dtype)
        local_terms = terms.forward_sums(z)
        sum_exp = _all_reduce(z.exp_().sum(-1), group)
        del z
        sums = _all_reduce(torch.stack(local_terms, -1), group).unbind(-1)
        log_sum_exp = sum_exp.log()
        loss = terms.loss(log_sum_exp, sums)
        count = terms.denominator(loss)
        scale = terms.softmax_scale(sums)
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = loss.sum() / count
        ctx.save_for_backward(logits, target, weight, maxima + log_sum_exp, scale, count)
        ctx.args = (reduction, ignore_index, smoothing, class_dim, offset, n_classes)
        out_dtype = (torch.promote_types(logits.dtype, target.dtype)  # dynamo traces it
                     if target.is_floating_point() else logits.dtype)
        # a new tensor, never ``loss`` itself: torch 2.11's dynamo, tracing this Function,
        # gives a zero gradient when the output is also one of its intermediates
        return loss.to(out_dtype, copy=True)

    @staticmethod
    def backward(ctx, grad):
        logits, target, weight, log_sum_exp, scale, count = ctx.saved_tensors
        reduction, ignore_index, smoothing, class_dim, offset, n_classes = ctx.args
        x = logits.movedim(class_dim, -1)
        dtype = log_sum_exp.dtype
        terms = _Terms(target, weight, ignore_index, smoothing, class_dim, offset, n_classes,
                       x.shape[-1], dtype)
        g = grad.to(dtype)
        if reduction == "mean":
            g = g / count
        g = g.expand(log_sum_exp.shape)
        grad_logits = grad_target = None
        if ctx.needs_input_grad[1]:
            grad_target = terms.target_grad(g, x, log_sum_exp).to(target.dtype)
            grad_target = grad_target.movedim(-1, class_dim)
        if ctx.needs_input_grad[0]:
            softmax = _shifted(x, log_sum_exp, dtype).exp_()
            grad_logits = terms.logits_grad(g, scale, softmax).to(logits.dtype)
            grad_logits = grad_logits.movedim(-1, class_dim)
        return grad_logits, grad_target, None, None, None, None, None, None, None, None


class _Terms:
    """The target-dependent parts of the loss and its gradient on this rank's classes.

    With log-sum-exp ``L``, shifted logits ``z = x - max`` and class weights ``w`` (ones if
    none), for smoothing ``e`` over ``C`` classes. Class-index target ``t`` (ignored tokens
    give 0): ``(1 - e) w_t (L - z_t) + e / C (sum_c w_c L - sum_c w_c z_c)``. Probability
    target ``q``, smoothed ``q' = (1 - e) q + e / C``: ``sum_c w_c q'_c (L - z_c)``.
    """

    def __init__(self, target, weight, ignore_index, smoothing, class_dim, offset, n_classes,
                 n_local, dtype):
        self.smoothing, self.n_classes = smoothing, n_classes
        self.weight = None if weight is None else weight.to(dtype)
        self.local_weight = (None if weight is None else
                             self.weight[offset:offset + n_local])
        self.probs = target.is_floating_point()
        if self.probs:
            q = target.movedim(class_dim, -1).to(dtype)
            q = q * (1 - smoothing) + smoothing / self.n_classes if smoothing else q
            self.q = q if weight is None else q * self.local_weight
            return
        self.total_weight = self.n_classes if weight is None else self.weight.sum()
        self.keep = target != ignore_index
        local = target - offset
        self.mine = self.keep & (local >= 0) & (local < n_local)
        self.index = local.clamp(0, n_local - 1).unsqueeze(-1)
        self.target_weight = (self.keep.to(dtype) if weight is None else
                              torch.where(self.keep, self.weight[target.clamp(
                                  0, self.n_classes - 1)], 0))

    def forward_sums(self, z: torch.Tensor) -> list[torch.Tensor]:
        """This rank's per-token class sums, to be all-reduced."""
        if self.probs:
            return [self.q.sum(-1), torch.linalg.vecdot(self.q, z)]
        sums = [torch.where(self.mine, z.gather(-1, self.index).squeeze(-1), 0)]
        if self.smoothing:
            sums.append(z.sum(-1) if self.weight is None else z @ self.local_weight)
        return sums

    def loss(self, log_sum_exp, sums) -> torch.Tensor:
        """The per-token loss from the log-sum-exp and the all-reduced class sums."""
        if self.probs:
            total_q, q_dot_z = sums
            return total_q * log_sum_exp - q_dot_z
        e = self.smoothing
        loss = self.target_weight * (log_sum_exp - sums[0])
        if e:
            smooth = torch.where(self.keep, self.total_weight * log_sum_exp - sums[1], 0)
            loss = (1 - e) * loss + e / self.n_classes * smooth
        return loss

    def denominator(self, loss) -> torch.Tensor:
        """What ``mean`` divides by: the token count for probability targets, else the
        summed weights of the non-ignored targets."""
        if self.probs:
            return torch.tensor(loss.numel(), dtype=loss.dtype, device=loss.device)
        return self.target_weight.sum()

    def softmax_scale(self, sums) -> torch.Tensor:
        """Per token, the factor of the softmax in dloss/dz: ``sum_c w_c q'_c``, or
        ``(1 - e) w_t + e / C sum_c w_c`` (0 for ignored tokens)."""
        if self.probs:
            return sums[0]
        e = self.smoothing
        return torch.where(self.keep, (1 - e) * self.target_weight +
                           e * self.total_weight / self.n_classes, 0)

    def logits_grad(self, g, scale, softmax) -> torch.Tensor:
        """``g * dloss/dz`` into the ``softmax`` buffer, for per-token upstream ``g``."""
        g = g.unsqueeze(-1)
        softmax.mul_(g * scale.unsqueeze(-1))
        if self.probs:
            return softmax.addcmul_(g, self.q, value=-1)
        e, w_t = self.smoothing, self.target_weight.unsqueeze(-1)
        g = torch.where(self.keep.unsqueeze(-1), g, 0)
        softmax.scatter_add_(-1, self.index, -(1 - e) * g * w_t * self.mine.unsqueeze(-1))
        if e and self.weight is None:
            softmax.sub_(g * (e / self.n_classes))
        elif e:
            softmax.addcmul_(g, self.local_weight, value=-e / self.n_classes)
        return softmax

    def target_grad(self, g, x, log_sum_exp) -> torch.Tensor:
        """``g * dloss/dq`` of probability targets: ``-(1 - e) w_c log_softmax_c``."""
        w = 1.0 if self.local_weight is None else self.local_weight
        return (g * (1 - self.smoothing)).unsqueeze(-1) * w * \
            (log_sum_exp.unsqueeze(-1) - x.to(log_sum_exp.dtype))
