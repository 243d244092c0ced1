#!/usr/bin/env python3
"""PyTorch's fused attention alone on a CUDA GPU: F.scaled_dot_product_attention with each of its
fused backends (FlashAttention-2, cuDNN), causal, forward and backward, over a list of T, at the
te preset's heads (B 8, n_head 32, d_head 128) in bf16. It is the bar stage 2's own kernels are
measured against: run it on the GPU that ran the ladder, and set its numbers beside the attention
rows there (`ladder --breakdown`, or Nsight Compute's kernel times).

    scripts/sdpa-bench.py --json sdpa.json                  # T = 512, 1024, 2048, 4096
    scripts/sdpa-bench.py --seq 1024,2048 --batch 4 --json sdpa.json

Timing: CUDA events around each call, after warm-up, on random inputs; the median of --iters.
The backward is timed alone (a forward outside the events builds the graph, then backward is
timed). FLOPs (causal, half the T x T products): forward 4·B·n_head·T²·d_head / 2, backward 2.5x
the forward (FlashAttention-2's count: five T x T products against two).

A backend this GPU or PyTorch build cannot run is a row "not run" with PyTorch's reason.
Exit code: 0 when every backend that could run did; 2 for a usage error or no CUDA GPU, before any
work. --json is written whole (a temporary file beside it, then renamed).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile


def usage(msg):
    print(f"sdpa-bench: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="512,1024,2048,4096", help="comma-separated T values (default 512,1024,2048,4096)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--d-head", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="where to write the results (optional)")
    a = p.parse_args()
    try:
        a.seq = [int(v) for v in a.seq.split(",") if v.strip()]
    except ValueError:
        usage(f"--seq {a.seq!r} is not a list of integers. Fix: e.g. --seq 512,1024,2048.")
    if not a.seq or min(a.seq) < 1 or min(a.batch, a.heads, a.d_head, a.iters) < 1 or a.warmup < 0:
        usage("--seq, --batch, --heads, --d-head and --iters must be positive (--warmup at least 0). Fix: pass positive values.")
    if a.json:
        d = os.path.dirname(os.path.abspath(a.json))
        if os.path.isdir(a.json) or not os.path.isdir(d) or not os.access(d, os.W_OK):
            usage(f"--json {a.json} is a folder, or its folder does not exist or is not writable. Fix: pass a file path in a writable folder.")
    return a


def main():
    a = parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        usage(f"cannot import PyTorch's SDPA backends ({e}). Fix: install PyTorch 2.3 or newer with CUDA.")
    if not torch.cuda.is_available():
        usage("PyTorch sees no CUDA GPU; this benchmark times GPU kernels. Fix: run it on a GPU machine.")
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    backends = {"flash-attention-2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    dev = torch.device("cuda")
    rows = []

    def timed(fn):
        for _ in range(a.warmup):
            fn()
        times = []
        for _ in range(a.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            prep = fn(prepare=True)
            start.record()
            prep()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), min(times), max(times)

    for t in a.seq:
        gen = torch.Generator(device=dev).manual_seed(t)
        # (B, n_head, T, d_head), as SDPA takes them
        q, k, v = (torch.randn(a.batch, a.heads, t, a.d_head, device=dev, dtype=dtype, generator=gen) for _ in range(3))
        do = torch.randn_like(q)
        fwd_flops = 4 * a.batch * a.heads * t * t * a.d_head / 2
        for name, backend in backends.items():
            row = {"backend": name, "batch": a.batch, "n_head": a.heads, "seq": t, "d_head": a.d_head, "dtype": a.dtype, "causal": True}
            try:
                with sdpa_kernel([backend]):
                    def fwd(prepare=False):
                        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        return run if prepare else run()

                    qg, kg, vg = (z.detach().clone().requires_grad_(True) for z in (q, k, v))

                    def bwd(prepare=False):
                        for z in (qg, kg, vg):
                            z.grad = None
                        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                        run = lambda: o.backward(do)
                        return run if prepare else run()

                    f_ms, f_min, f_max = timed(fwd)
                    b_ms, b_min, b_max = timed(bwd)
                row.update({"forward_ms": f_ms, "forward_min_ms": f_min, "forward_max_ms": f_max,
                            "forward_tflops": fwd_flops / f_ms / 1e9,
                            "backward_ms": b_ms, "backward_min_ms": b_min, "backward_max_ms": b_max,
                            "backward_tflops": 2.5 * fwd_flops / b_ms / 1e9})
                print(f"sdpa-bench: {name:18} T {t:5}: forward {f_ms:8.3f} ms {row['forward_tflops']:6.0f} TFLOP/s · "
                      f"backward {b_ms:8.3f} ms {row['backward_tflops']:6.0f} TFLOP/s")
            except RuntimeError as e:
                row["not_run"] = str(e).splitlines()[0][:300]
                print(f"sdpa-bench: {name} T {t}: not run: {row['not_run']}", file=sys.stderr)
            rows.append(row)
        del q, k, v, do
        torch.cuda.empty_cache()
    doc = {"schema": "candle-speedkit/sdpa-bench/1", "torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
           "cudnn": torch.backends.cudnn.version(), "warmup": a.warmup, "iters": a.iters,
           "timing": "CUDA events per call, median of iters; backward timed alone", "rows": rows}
    if a.json:
        fd, tmp = tempfile.mkstemp(prefix=".sdpa-bench.", dir=os.path.dirname(os.path.abspath(a.json)))
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, a.json)
        print(f"sdpa-bench: wrote {a.json}")


if __name__ == "__main__":
    main()
