#!/usr/bin/env python3
"""Count the SASS instructions of each loop of a kernel, to price one trip of its main loop.

Reads `cuobjdump -sass` (or `nvdisasm`) output of one function from FILE, or stdin without one. A loop is the range from
a backward branch's target to the branch itself. For each loop it prints the instructions in the
range, the tensor-core instructions (HMMA) among them, and the instructions per 128 HMMA, then a
histogram by opcode for the loop with the most HMMA. Instructions that a forward branch inside the
loop jumps over (the code of an `if` not taken) are counted apart, as `skippable`: the static
count is what one trip issues when every such `if` runs, the count without them when none does.

    cuobjdump -sass -fun flash_attn_v2_fwd_bf16_d128 k.cubin | python3 scripts/sass-loops.py
    python3 scripts/sass-loops.py kernel.sass
    python3 scripts/sass-loops.py --json kernel.sass

--json prints one JSON object instead: every loop's range and counts, and for the loop with the most
HMMA its opcodes by full mnemonic (`LDS.64`, `REDG.E.ADD.F32.FTZ.RN.STRONG.GPU`) twice, without and
with the skippable instructions (`opcodes`, `opcodes_with_skippable`).

Exit code: 0 with a loop found, 1 for an input with no SASS or no loop, 2 for a usage error (an
unknown argument, a file that is missing, a folder, unreadable or not text).
"""
import collections
import json
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


USAGE = "usage: sass-loops.py [--json] [FILE]  (FILE: `cuobjdump -sass` output of one function; stdin without it or with -)"


def refuse(msg: str) -> None:
    print(f"sass-loops: {msg}", file=sys.stderr)
    sys.exit(2)


def read_input(args: list) -> str:
    """The listing's text, from the one FILE argument or stdin; a one-line refusal for anything else."""
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        sys.exit(0)
    if len(args) > 1 or (args and args[0].startswith("-") and args[0] != "-"):
        refuse(f"unexpected arguments {' '.join(args)}. Fix: pass at most one file. {USAGE}")
    path = args[0] if args and args[0] != "-" else None
    name = path or "stdin"
    try:
        if path is None:
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as fh:
                data = fh.read()
    except IsADirectoryError:
        refuse(f"{path} is a folder, not a SASS listing. Fix: pass one file of `cuobjdump -sass` output.")
    except FileNotFoundError:
        refuse(f"{path} does not exist. Fix: pass a file of `cuobjdump -sass` output (see --help).")
    except OSError as e:
        refuse(f"cannot read {name}: {e.strerror or e}. Fix: pass a readable file of `cuobjdump -sass` output.")
    try:
        if b"\0" in data:
            raise UnicodeError
        return data.decode("utf-8")
    except UnicodeError:
        refuse(f"{name} is not text (a cubin or other binary?). Fix: disassemble it first: "
               f"cuobjdump -sass -fun KERNEL FILE.cubin | python3 scripts/sass-loops.py")


def main() -> int:
    args = sys.argv[1:]
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    instrs = []  # (address, opcode, operands)
    for line in read_input(args).splitlines():
        m = LINE.search(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    if not instrs:
        print("no SASS instructions in the input", file=sys.stderr)
        return 1
    index = {a: i for i, (a, _, _) in enumerate(instrs)}
    loops = []
    for i, (addr, op, args) in enumerate(instrs):
        t = re.search(r"0x([0-9a-f]+)", args)
        if op.startswith("BRA") and t and int(t.group(1), 16) < addr and int(t.group(1), 16) in index:
            loops.append((index[int(t.group(1), 16)], i))
    if not loops:
        print("no loop (backward branch) found", file=sys.stderr)
        return 1
    best = None
    records = []
    for lo, hi in loops:
        body = instrs[lo : hi + 1]
        hmma = sum(op.startswith("HMMA") for _, op, _ in body)
        skipped = set()
        for k, (addr, op, args) in enumerate(body):
            t = re.search(r"0x([0-9a-f]+)", args)
            if op.startswith("BRA") and t and addr < int(t.group(1), 16) <= body[-1][0]:
                end = int(t.group(1), 16)
                skipped.update(j for j in range(lo + k + 1, hi + 1) if instrs[j][0] < end)
        n, s = len(body), len(skipped)
        per = f", {128 * (n - s) / hmma:.0f} per 128 HMMA without the skippable, {128 * n / hmma:.0f} with" if hmma else ""
        records.append({"start": f"0x{instrs[lo][0]:04x}", "end": f"0x{instrs[hi][0]:04x}", "instructions": n,
                        "skippable": s, "hmma": hmma})
        if not as_json:
            print(f"loop 0x{instrs[lo][0]:04x}..0x{instrs[hi][0]:04x}: {n} instructions ({s} skippable), {hmma} HMMA{per}")
        if best is None or hmma >= best[0]:  # the last of equals: the unmasked loop comes after the masked one
            best = (hmma, lo, hi, skipped, records[-1])
    _, lo, hi, skipped, record = best
    if as_json:
        full = lambda keep: dict(collections.Counter(instrs[j][1] for j in range(lo, hi + 1) if keep(j)).most_common())
        out = {"loops": records, "most_hmma": record,
               "opcodes": full(lambda j: j not in skipped), "opcodes_with_skippable": full(lambda j: True)}
        print(json.dumps(out, indent=1))
        return 0
    hist = collections.Counter(instrs[j][1].split(".")[0] for j in range(lo, hi + 1) if j not in skipped)
    print("opcodes of the loop with the most HMMA (skippable left out):")
    for op, c in hist.most_common():
        print(f"  {op:10s} {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
