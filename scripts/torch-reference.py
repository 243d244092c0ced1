#!/usr/bin/env python3
"""PyTorch reference rows for a recorded ladder run: the same block, the same weights and the same
input in PyTorch, checked against the run's fp32 stage-0 output and timed on the run's device (the
CPU, or the run's CUDA GPU: run it on the machine that recorded the run). The rows join the run's
JSON as reference rows (the ladder's schema, `references`), so `ladder render` shows them beside the
candle-nn row, and every row's "vs best reference" is recomputed over all of them.

A `--train` run gets training rows: the ladder's training step in PyTorch, timed as the ladder
times it (forward, the loss <y, r> and backward to every weight and x together; the update apart).
The run's --save-output file holds r, the seeded upstream gradient dL/dy the ladder used, and
stage 0's fp32 autograd gradients that every stage was checked against, as grad_<name> for ln1_g
ln1_b w_qkv b_qkv w_proj b_proj ln2_g ln2_b w_fc1 b_fc1 w_fc2 b_fc2 x, in the ladder's layout:
matrices (out, in), so w_qkv is (3C, C), w_fc1 (FF, C), w_fc2 (C, FF), and grad_x is (B, T, C). This script
transposes GPT-2's Conv1D (in, out) weights from --weights to (out, in) before the step, so each
parameter's .grad is in that layout already; each of the 13 shapes is checked, and a transpose
that kept a shape (w_proj is C x C) fails the values. Each gradient is checked as the ladder checks
a stage's, max|g - g_ref| / max|g_ref| per gradient, the worst against the tolerance (fp32 1e-5,
bf16 2e-2, shared::train::grad_tolerance), recorded in the row's train.grad_check and worst_grad;
a failed gradient check fails the row as a failed output check does. The update is
torch.optim.AdamW (lr 1e-4, its defaults otherwise, as candle-nn's), fused (one kernel over every
tensor, on the CPU too); where this PyTorch refuses fused, foreach runs, and the row's optimizer
name and notes say so. The update itself is not checked. A training run's io file without r and
the gradients is refused (exit 2): record the run again with this ladder, without --no-check.

    ladder --preset small --reference --json run.json --save-weights w.safetensors --save-output io.safetensors
    (or, for training rows: ladder --preset small --train --reference --json run.json ...)
    scripts/torch-reference.py --ladder-json run.json --weights w.safetensors --io io.safetensors --out run-torch.json
    ladder render --from run-torch.json --markdown

Rows: PyTorch eager fp32 (F.scaled_dot_product_attention, as a PyTorch user writes the block; its
output and gradients are held to stage 0's naive attention at fp32's tolerances, as stage 2's
are), eager with bf16 autocast, and torch.compile with bf16 autocast (needs a C++ compiler; a
variant that cannot run here is a reference row "not run" with the reason). Timed after the
ladder's run, not in its interleaved rounds, with the ladder's warm-up and iteration counts and its
thread count; on CUDA each iteration ends with torch.cuda.synchronize() (wall time, as the ladder),
fp32 has TF32 off (as stage 0), and peak memory is torch.cuda.max_memory_allocated.

Exit code: 0 when every row that ran passed its checks, 1 when one failed one (its output, or in a
training run its gradients) or no row ran, 2 for a usage error (arguments, unreadable or
mismatched files, torch not installed), before any work. --out is written whole or not at all (a
temporary file beside it, then renamed) and is never one of the inputs.
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

SCHEMAS = ("candle-speedkit/ladder/v1", "candle-speedkit/ladder/v2")
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # shared::check::tolerance
GRAD_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # shared::train::grad_tolerance
# shared::train::NAMES: the 12 weights in BlockWeights' order (GPT2's, one for one), then x.
NAMES = ["ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_proj", "b_proj", "ln2_g", "ln2_b", "w_fc1", "b_fc1", "w_fc2", "b_fc2", "x"]
GPT2 = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]


def usage(msg):
    print(f"torch-reference: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder-json", required=True, help="the JSON a `ladder --reference --json PATH` run wrote")
    p.add_argument("--weights", required=True, help="the same run's --save-weights file (GPT-2 names, one layer)")
    p.add_argument("--io", required=True, help="the same run's --save-output file (x and y_stage0_baseline; "
                                              "with --train also r and grad_<name>)")
    p.add_argument("--out", required=True, help="where to write the run's JSON with the PyTorch rows added")
    p.add_argument("--variants", default="eager-fp32,eager-bf16,compile-bf16",
                   help="comma-separated, from eager-fp32, eager-bf16, compile-bf16 (default: all three)")
    a = p.parse_args()
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if not names or bad:
        usage(f"--variants {a.variants!r} names {bad or 'nothing'}; the variants are {', '.join(VARIANTS)}. "
              f"Fix: pick some of them, comma-separated.")
    a.variants = names
    for flag, path in [("--ladder-json", a.ladder_json), ("--weights", a.weights), ("--io", a.io)]:
        if not os.path.isfile(path):
            usage(f"{flag} {path} is not a file. Fix: pass the file the ladder run wrote (see --help).")
        try:
            open(path, "rb").close()
        except OSError as e:
            usage(f"{flag} {path} cannot be read: {e.strerror or e}. Fix: make it readable (e.g. chmod u+r {path}), "
                  f"or pass a copy you can read.")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if os.path.isdir(a.out) or not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        usage(f"--out {a.out} is a folder, or its folder does not exist or is not writable. Fix: pass a file path in a writable folder.")
    for path in (a.ladder_json, a.weights, a.io):
        if os.path.exists(a.out) and os.path.samefile(a.out, path):
            usage(f"--out {a.out} is one of the inputs ({path}); inputs are never overwritten. Fix: pass a new path for --out.")
    return a


def load_run(path):
    try:
        with open(path) as fh:
            run = json.load(fh)
    except (OSError, ValueError) as e:
        usage(f"--ladder-json {path} is not a ladder JSON ({e}). Fix: pass the file `ladder --json PATH` wrote.")
    if not isinstance(run, dict) or run.get("schema") not in SCHEMAS:
        usage(f"--ladder-json {path} has schema {run.get('schema') if isinstance(run, dict) else None!r}, not one of {SCHEMAS}. "
              f"Fix: pass one ladder run's JSON (not a sweep's or a stage binary's).")
    records = run.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        usage(f"--ladder-json {path} has no list of records. Fix: pass the unedited file `ladder --json PATH` wrote.")
    for key in ("references", "references_out"):
        if not isinstance(run.get(key, []), list) or not all(isinstance(r, dict) and isinstance(r.get("stage"), str)
                                                              for r in run.get(key, [])):
            usage(f"--ladder-json {path}: {key} is not a list of rows. Fix: pass the unedited file `ladder --json PATH` wrote.")
    stage0 = [r for r in records if r.get("stage") == "stage0_baseline"]
    if not stage0:
        usage(f"--ladder-json {path} has no stage0_baseline row, so there is no speedup to compute and no reference "
              f"output to check against. Fix: run the ladder with stage 0 (the default --stages).")
    fields = [(run, "shape", dict), (run, "device", dict), (stage0[0], "warmup", int), (stage0[0], "iters", int),
              (stage0[0], "timing", dict), (stage0[0], "flops_per_forward", (int, float))]
    fields += [(run.get("shape"), k, int) for k in ("batch", "seq", "d_model", "n_head", "ff")]
    fields += [(stage0[0].get("timing"), "median_ms", (int, float))]
    for obj, key, kind in fields:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
            usage(f"--ladder-json {path} lacks {key} (or it is not a {getattr(kind, '__name__', 'number')}), which the "
                  f"PyTorch rows need. Fix: pass the unedited file `ladder --json PATH` wrote.")
    if run["device"].get("kind") not in ("cpu", "cuda"):
        usage(f"--ladder-json records a run on {run['device'].get('kind')!r}; this script times the CPU and CUDA. "
              f"Fix: pass a CPU or CUDA run.")
    if run["device"]["kind"] == "cpu" and not isinstance(run["device"].get("threads"), int):
        usage(f"--ladder-json {path} lacks device.threads (the CPU run's thread count). Fix: pass the unedited file "
              f"`ladder --json PATH` wrote.")
    return run, stage0[0]


FLOATS = ("F64", "F32", "F16", "BF16")


def safetensors_header(flag, path):
    """{name: (dtype, shape)} from a safetensors file's header (8-byte little-endian length, then
    JSON), read without PyTorch so a wrong file is refused before it is imported."""
    bad = f"{flag} {path} is not a safetensors file"
    fix = "Fix: pass the file the same ladder run wrote (--save-weights for --weights, --save-output for --io)."
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else 0
            if not 0 < n <= min(size - 8, 100 << 20):
                usage(f"{bad} (its header length {n} does not fit its {size} bytes). {fix}")
            head = json.loads(fh.read(n))
    except OSError as e:
        usage(f"{flag} {path} cannot be read: {e.strerror or e}. Fix: make it readable, or pass a copy you can read.")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        usage(f"{bad} (its header is not JSON: {e}). {fix}")
    if not isinstance(head, dict):
        usage(f"{bad} (its header is not a table of tensors). {fix}")
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        ok = isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list) \
            and all(isinstance(d, int) and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list) \
            and len(t["data_offsets"]) == 2 and all(isinstance(o, int) for o in t["data_offsets"])
        if not ok or not 0 <= t["data_offsets"][0] <= t["data_offsets"][1] <= size - 8 - n:
            usage(f"{bad} (tensor {name!r} has a malformed entry or lies past the file's end: truncated?). {fix}")
        out[name] = (t["dtype"], t["shape"])
    return out


def grad_shapes(shape):
    """{grad_<name>: dims} of the reference gradients a training run's --save-output holds: the
    ladder's layout, matrices (out, in)."""
    b, t, c, ff = shape["batch"], shape["seq"], shape["d_model"], shape["ff"]
    dims = [[c], [c], [3 * c, c], [3 * c], [c, c], [c], [c], [c], [ff, c], [ff], [c, ff], [c], [b, t, c]]
    return {f"grad_{n}": d for n, d in zip(NAMES, dims)}


def check_inputs(a, shape, train):
    """Refuse weights or io tensors whose names, dtypes or shapes are not the run's, naming the
    file and the tensor, before PyTorch is imported."""
    b, t, c, ff = shape["batch"], shape["seq"], shape["d_model"], shape["ff"]
    head = safetensors_header("--weights", a.weights)
    layers = sorted({k.split(".")[1] for k in head if k.startswith("h.") and k.endswith(".ln_1.weight")})
    if len(layers) != 1:
        usage(f"--weights {a.weights} holds layers {layers}, not one. Fix: pass the --save-weights file of the run.")
    # GPT-2's Conv1D layout, (in, out), as --save-weights writes it.
    want = {"ln_1.weight": [c], "ln_1.bias": [c], "attn.c_attn.weight": [c, 3 * c], "attn.c_attn.bias": [3 * c],
            "attn.c_proj.weight": [c, c], "attn.c_proj.bias": [c], "ln_2.weight": [c], "ln_2.bias": [c],
            "mlp.c_fc.weight": [c, ff], "mlp.c_fc.bias": [ff], "mlp.c_proj.weight": [ff, c], "mlp.c_proj.bias": [c]}
    expected = {f"h.{layers[0]}.{n}": s for n, s in want.items()}
    expected_io = {"x": [b, t, c], "y_stage0_baseline": [b, t, c]}
    io = safetensors_header("--io", a.io)
    if train:
        expected_io.update({"r": [b, t, c], **grad_shapes(shape)})
        missing = [n for n in expected_io if n not in io and (n == "r" or n.startswith("grad_"))]
        if missing:
            usage(f"--io {a.io} lacks {', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''}: --ladder-json is a "
                  f"--train run, and its PyTorch rows run the ladder's step on the ladder's upstream gradient r and check "
                  f"their gradients against stage 0's (grad_<name>), which a training run's --save-output holds only when "
                  f"written by this version's ladder without --no-check. Fix: re-record the run with this version (ladder "
                  f"--train ... --json run.json --save-weights w.safetensors --save-output io.safetensors, without "
                  f"--no-check) and pass its three files.")
    for flag, path, tensors, need in [("--weights", a.weights, head, expected), ("--io", a.io, io, expected_io)]:
        for name, dims in need.items():
            if name not in tensors:
                usage(f"{flag} {path} has no tensor {name}. Fix: pass the {'--save-weights' if flag == '--weights' else '--save-output'} "
                      f"file of the same ladder run.")
            dtype, got = tensors[name]
            if dtype not in FLOATS or got != dims:
                usage(f"{flag} {path}: tensor {name} is {dtype} {got}, but the run (B={b} T={t} C={c} FF={ff}) needs a "
                      f"float tensor of shape {dims}. Fix: pass the files written by the same ladder run as --ladder-json.")
    return layers[0]


def stats(samples):
    """shared::timing::Stats: percentiles by linear interpolation between closest ranks."""
    s = sorted(samples)

    def q(p):
        pos = p * (len(s) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "max_ms": s[-1], "samples_ms": samples}


def block(torch, F, w, n_head):
    """The block: pre-LN GPT-2 layer, causal attention, tanh GELU; w holds (out, in) matrices."""

    def forward(x):
        b, t, c = x.shape
        h = F.layer_norm(x, (c,), w["ln_1.weight"], w["ln_1.bias"], 1e-5)
        q, k, v = F.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(c, dim=-1)
        heads = lambda z: z.reshape(b, t, n_head, c // n_head).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, c), w["attn.c_proj.weight"], w["attn.c_proj.bias"])
        h = F.layer_norm(x, (c,), w["ln_2.weight"], w["ln_2.bias"], 1e-5)
        m = F.gelu(F.linear(h, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"]), approximate="tanh")
        return x + F.linear(m, w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])

    return forward


class GradShapeError(Exception):
    """A gradient this script's step did not produce in the reference's shape: its layout is wrong."""


def compare_grads(torch, got, reference, tolerance):
    """shared::train::compare_grads: per gradient max|g - g_ref| / max|g_ref| (max|g - g_ref| where
    g_ref is all zeros), in f64 over g's finite values; the worst (max_norm_ratio) against
    `tolerance`, and its name (the first with a NaN or infinity, if any). max_abs_err is the largest
    |g - g_ref| of all; tensors each gradient's own max |g - g_ref| and ratio."""
    worst, at, bad, raw, tensors = 0.0, 0, 0, 0.0, []
    for i, (g, ref) in enumerate(zip(got, reference)):
        g, ref = g.detach().double().cpu(), ref.double()
        finite = torch.isfinite(g)
        nan = int((~finite).sum())
        d = (g - ref).abs()[finite]
        diff = float(d.max()) if d.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        e = diff / scale if scale > 0 else diff
        if bad == 0 and (e > worst or nan > 0):
            at = i
        worst, bad, raw = max(worst, e), bad + nan, max(raw, diff)
        tensors.append({"name": NAMES[i], "max_abs_err": diff, "max_norm_ratio": e})
    check = {"max_norm_ratio": worst, "max_abs_err": raw, "tolerance": tolerance, "non_finite": bad,
             "passed": bad == 0 and worst <= tolerance, "tensors": tensors}
    return check, NAMES[at]


def adamw(torch, params):
    """The update: torch.optim.AdamW at the ladder's lr (1e-4; betas, eps and weight decay are
    PyTorch's defaults, as candle-nn's), fused (on the CPU since torch 2.4), else foreach. Returns
    the optimizer, its name as recorded, and a note when fused was refused."""
    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True), "torch.optim.AdamW(fused=True)", []
    except (RuntimeError, ValueError, TypeError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        note = f"torch.optim.AdamW(fused=True) raised on this PyTorch ({why}); foreach ran instead"
        print(f"torch-reference: {note}", file=sys.stderr)
        return torch.optim.AdamW(params, lr=1e-4, foreach=True), "torch.optim.AdamW(foreach=True; fused refused)", [note]


VARIANTS = {
    # name: (row name, precision, autocast bf16, torch.compile)
    "eager-fp32": ("pytorch eager", "fp32", False, False),
    "eager-bf16": ("pytorch eager bf16", "bf16", True, False),
    "compile-bf16": ("pytorch compile bf16", "bf16", True, True),
}


def main():
    a = parse_args()
    run, stage0 = load_run(a.ladder_json)
    train = stage0.get("mode") == "train"  # a --train run (schema v2); v1 runs are forward runs
    layer = check_inputs(a, run["shape"], train)
    try:
        import torch
        import torch.nn.functional as F
        from safetensors.torch import load_file
    except ImportError as e:
        usage(f"cannot import PyTorch ({e}). Fix: pip install torch safetensors (a CPU build is enough).")
    try:
        tensors, raw = load_file(a.io), load_file(a.weights)
    except Exception as e:  # safetensors raises its own error types; the header was checked above
        usage(f"cannot load --io {a.io} or --weights {a.weights}: {type(e).__name__}: {e}. Fix: pass the files the same "
              f"ladder run wrote.")
    w = {n: raw[f"h.{layer}.{n}"].float() for n in GPT2}
    for n in GPT2:
        if w[n].dim() == 2:
            w[n] = w[n].t().contiguous()  # GPT-2's Conv1D (in, out) to F.linear's (out, in)
    shape = run["shape"]
    cuda = run["device"]["kind"] == "cuda"
    if cuda and not torch.cuda.is_available():
        usage("--ladder-json records a CUDA run, but this PyTorch sees no CUDA GPU. Fix: run this script on the machine "
              "that recorded the run, with a CUDA build of PyTorch.")
    dev = torch.device(f"cuda:{run['device'].get('ordinal', 0)}" if cuda else "cpu")
    x, want = tensors["x"].float().to(dev), tensors["y_stage0_baseline"].float()  # shapes checked by check_inputs
    if train:
        r = tensors["r"].float().to(dev)  # the ladder's upstream gradient dL/dy
        want_grads = [tensors[f"grad_{n}"].float() for n in NAMES]
    w = {n: t.to(dev) for n, t in w.items()}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as stage 0: TF32 off
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(run["device"]["threads"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warmup, iters = stage0["warmup"], stage0["iters"]
    t0 = stage0["timing"]["median_ms"]
    rows, out, failed = [], [], False
    for name in a.variants:
        row, precision, bf16, compiled = VARIANTS[name]
        try:
            params = {n: t.clone().requires_grad_(train) for n, t in w.items()}  # fp32 masters, as autocast trains
            forward = block(torch, F, params, shape["n_head"])
            f = torch.compile(forward) if compiled else forward
            autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)
            if train:
                xg = x.clone().requires_grad_(True)
                opt, optimizer, fallback = adamw(torch, list(params.values()))

                def once():
                    for p_ in [xg, *params.values()]:
                        p_.grad = None
                    with autocast():
                        y = f(xg)
                    (y.float() * r).sum().backward()  # L = <y, r>: dL/dy = r
                    return y

                # The checks come before any timing, on the weights the reference's gradients were taken at.
                with torch.no_grad(), autocast():
                    y = f(x).float().cpu()
                once()
                # GPT2 order is NAMES' order; each .grad is (out, in) as the parameter (transposed on load).
                got = [params[n].grad for n in GPT2] + [xg.grad]
                if any(g is None for g in got):
                    raise GradShapeError(f"the backward reached no gradient for {NAMES[[g is None for g in got].index(True)]}")
                for n, g, ref in zip(NAMES, got, want_grads):
                    if list(g.shape) != list(ref.shape):
                        raise GradShapeError(f"the gradient of {n} has shape {list(g.shape)}, the reference's {list(ref.shape)}")
                grad_check, worst_grad = compare_grads(torch, got, want_grads, GRAD_TOLERANCE[precision])
                del got
            else:
                def once():
                    with torch.inference_mode(), autocast():
                        return f(x)

                y = once().float().cpu()  # the check comes before any timing
            for _ in range(warmup):
                once()
                if train:
                    opt.step()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            samples, opt_samples = [], []
            for _ in range(iters):
                start = time.perf_counter()
                once()
                sync()
                samples.append((time.perf_counter() - start) * 1e3)
                if train:
                    start = time.perf_counter()
                    opt.step()
                    sync()
                    opt_samples.append((time.perf_counter() - start) * 1e3)
            peak = torch.cuda.max_memory_allocated(dev) if cuda else None
        except GradShapeError as e:  # the script's own layout is wrong: a failed row, not one that cannot run here
            out.append({"stage": row, "technique": "reference: PyTorch", "reason": f"gradient check: {e}", "failed": True})
            print(f"torch-reference: {row} FAILED: {out[-1]['reason']}", file=sys.stderr)
            failed = True
            continue
        except Exception as e:  # a variant this machine cannot run (no compiler for torch.compile) is a row saying so
            out.append({"stage": row, "technique": "reference: PyTorch", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                        "failed": False})
            print(f"torch-reference: {row} not run: {out[-1]['reason']}", file=sys.stderr)
            continue
        finally:
            if cuda:
                torch.cuda.empty_cache()
        d = (y - want).double()
        finite = torch.isfinite(y)
        rel = math.sqrt(float((d[finite] ** 2).sum()) / max(float((want.double() ** 2).sum()), 1e-300))
        check = {"rel_err": rel, "max_abs_err": float(d[finite].abs().max()), "tolerance": TOLERANCE[precision],
                 "non_finite": int((~finite).sum()), "passed": bool(finite.all()) and rel <= TOLERANCE[precision]}
        failed |= not check["passed"] or (train and not grad_check["passed"])
        t = stats(samples)
        secs = t["median_ms"] / 1e3
        rec = dict(stage0)  # device, shape, seed, weights, ceiling, mode and the rest as the run recorded them
        notes = ["timed by scripts/torch-reference.py after the ladder's run, not in its interleaved rounds"]
        if train:
            notes.append(f"training step as the ladder times it (forward + <y, r> + backward, r the ladder's own), then "
                         f"{optimizer} (timed apart); the 13 gradients checked against stage 0's fp32 autograd "
                         f"(worst: d{worst_grad}); the update is not checked")
            notes.extend(fallback)
            rec["train"] = {"optimizer": optimizer, "optimizer_timing": stats(opt_samples),
                            "grad_check": grad_check, "worst_grad": worst_grad, "optimizer_check": None, "skipped_steps": 0}
        rec.update({
            "stage": row, "technique": f"reference: PyTorch {torch.__version__}, F.scaled_dot_product_attention" +
            (", torch.compile" if compiled else ""),
            "precision": precision, "precision_reason": "bf16 autocast (LayerNorm and softmax in f32)" if bf16 else "fp32",
            "implementation": f"torch {torch.__version__}, " + (torch.cuda.get_device_name(dev) if cuda else torch.backends.cpu.get_cpu_capability()),
            "gemm_switches": {"tf32": False, "reduced_f16": False, "reduced_bf16": False},
            "iters": iters, "timing": t, "tokens_per_s": shape["batch"] * shape["seq"] / secs,
            "tflops": stage0["flops_per_forward"] / secs / 1e12, "check": check, "extra_checks": [],
            "peak_mem_bytes": peak, "mem_method": "torch.cuda.max_memory_allocated" if cuda else "not measured (PyTorch)",
            "speedup_vs_stage0": t0 / t["median_ms"],
            "speedup_vs_prev": None, "noise_vs_stage0": False, "noise_vs_prev": False, "breakdown": None, "variant": None,
            "notes": notes,
        })
        peak_tflops = stage0.get("peak_tflops")
        rec["pct_of_peak"] = 100 * rec["tflops"] / peak_tflops if peak_tflops and precision == "fp32" else None
        if precision != "fp32":
            rec["peak_tflops"] = rec["peak_source"] = None
        rows.append(rec)
        grads = f", worst grad error {grad_check['max_norm_ratio']:.2e} (d{worst_grad}, tolerance {grad_check['tolerance']:.0e})" if train else ""
        passed = check["passed"] and (not train or grad_check["passed"])
        print(f"torch-reference: {row}: {t['median_ms']:.3f} ms, {t0 / t['median_ms']:.2f}x over stage 0, rel err {rel:.2e}"
              f"{grads}{'' if passed else ' FAILED'}")
    run["references"] = [r for r in run.get("references", []) if not r["stage"].startswith("pytorch")] + rows
    run["references_out"] = [r for r in run.get("references_out", []) if not r["stage"].startswith("pytorch")] + out
    best = min((r["timing"]["median_ms"] for r in run["references"]), default=None)
    for r in run["records"] + run["references"]:
        r["vs_reference"] = best / r["timing"]["median_ms"] if best else None
    fd, tmp = tempfile.mkstemp(prefix=".torch-reference.", dir=os.path.dirname(os.path.abspath(a.out)))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would create it, not mkstemp's 0600
    with os.fdopen(fd, "w") as fh:
        json.dump(run, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, a.out)
    print(f"torch-reference: wrote {a.out} ({len(rows)} PyTorch rows)")
    if not rows:
        print(f"torch-reference: no PyTorch row ran ({len(out)} not run, each with its reason above and in "
              f"references_out). Fix: see the reasons; --variants eager-fp32 needs nothing but PyTorch.", file=sys.stderr)
    sys.exit(1 if failed or not rows else 0)


if __name__ == "__main__":
    main()
