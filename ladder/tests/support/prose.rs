//! The docs checks' reading of prose: which numbers are citations (`cite`), and which
//! measured-looking numbers are not.

use crate::cite::{expected, find, update, Citation};
use regex::Regex;
use serde_json::Value;
use std::sync::LazyLock;

/// What is not prose on a line: inline code, an HTML comment, a link's text and target.
static NOT_PROSE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"`[^`]*`|<!--.*?-->|\[[^\[]*?\]\([^)]*\)").unwrap());
/// A number, with its exponent when one follows (`2.8e-2`).
static NUMBER: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"[0-9]+(?:\.[0-9]+)*(?:e(?:-[0-9]*|[0-9]+))?").unwrap());

/// Units that mark a number as a measurement (a time, a rate, a ratio, a size, an error).
const MEASURED_UNITS: [&str; 14] = ["ms", "µs", "s", "x", "GFLOP/s", "TFLOP/s", "GB/s", "TB/s", "%", "MiB", "GiB", "MB", "GB", "KB"];

/// (line, number) for each measured-looking number in `doc`'s prose that is not cited: one with a
/// unit of `MEASURED_UNITS` or in e-notation with a decimal, outside code, links, HTML comments
/// and generated regions (`<!-- NAME:begin -->`…`end`), and not a bound (≥ ≤ < >) or ≈1.0x.
pub fn bare_numbers(doc: &str) -> Vec<(usize, String)> {
    let (mut out, mut fenced, mut generated) = (Vec::new(), false, false);
    for (i, line) in doc.lines().enumerate() {
        let t = line.trim_start();
        let comment = t.starts_with("<!--");
        if t.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        generated |= comment && t.contains(":begin");
        if comment && t.contains(":end") {
            generated = false;
        } else if !fenced && !generated {
            out.extend(numbers_in(&NOT_PROSE.replace_all(line, " ")).into_iter().map(|n| (i + 1, n)));
        }
    }
    out
}

/// The measured-looking numbers of a prose line (see `bare_numbers`).
fn numbers_in(prose: &str) -> Vec<String> {
    let measured = |m: &regex::Match| {
        let (before, n, after) = (&prose[..m.start()], m.as_str(), &prose[m.end()..]);
        let starts = !before.chars().next_back().is_some_and(|c| c.is_alphanumeric() || "._-/".contains(c));
        // A measured error has a decimal (1.8e-2); a tolerance is a round power (1e-2), a constant.
        let e_notation = n.split_once('e').is_some_and(|(mantissa, _)| mantissa.contains('.'));
        // The unit: right after the number or after one space, ending at a word boundary.
        let unit = after.strip_prefix(' ').unwrap_or(after);
        let has_unit =
            MEASURED_UNITS.iter().any(|u| unit.strip_prefix(u).is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric() || c == '/')));
        // ≥ ≤ < > mark a target or bound; ≈ marks the noise label (`≈1.0x`), not a value.
        let last3: String = before.chars().rev().take(3).collect::<Vec<_>>().into_iter().rev().collect();
        let bound = ["≥", "≤", "<", ">", "≈"].iter().any(|b| last3.trim_end().ends_with(b));
        starts && (has_unit || e_notation) && !bound
    };
    NUMBER.find_iter(prose).filter(measured).map(|m| m.as_str().to_string()).collect()
}

/// Each citation in `doc` whose text is not what its JSON (read by `load`) holds, and why.
pub fn check(doc: &str, mut load: impl FnMut(&str) -> Result<Value, String>) -> Vec<(Citation, String)> {
    let verdict = |c: Citation| match load(&c.json).and_then(|j| expected(&c, &j)) {
        Ok(want) if want == c.text => None,
        Ok(want) => Some((c, format!("should read {want}"))),
        Err(e) => Some((c, e)),
    };
    find(doc).into_iter().filter_map(verdict).collect()
}

#[test]
fn bare_measured_numbers_are_found_and_cited_ones_are_not() {
    let doc = "Stage 3 takes 300 ms and buys 1.31x; [93.0 ms](results/a.json \"x\") is cited.\n\
               Error 2.8e-2 at te (tolerance 1e-2), 58.8% of the ceiling, 12 GB/s.\n\
               Targets: ≥ 80 % and ≥ 1.4x, within noise ≈1.0x. d_head 64, sm_90, 16 bytes, 2 cores, step 3, h100-98cd396.\n\
               `cargo run -- --iters 10` and <!-- 5 ms --> are not prose.\n\
               ```\n12 ms in a code block\n```\n\
               <!-- results:begin -->\n| 550 ms |\n<!-- results:end -->\n\
               After: 1.2x.";
    let found: Vec<(usize, String)> = bare_numbers(doc);
    let want: Vec<(usize, String)> =
        [(1, "300"), (1, "1.31"), (2, "2.8e-2"), (2, "58.8"), (2, "12"), (11, "1.2")].iter().map(|(l, n)| (*l, n.to_string())).collect();
    assert_eq!(found, want);
}

fn json() -> Value {
    serde_json::json!({
        "records": [
            {"stage": "stage0_baseline", "timing": {"median_ms": 445.12}, "peak_mem_bytes": 290766438u64},
            {"stage": "stage3_fused", "speedup_vs_prev": 1.4432, "check": {"rel_err": 0.0182}}
        ]
    })
}

#[test]
fn finds_checks_and_updates_citations() {
    let doc = "Fusion buys [1.44x](results/a.json \"records[stage=stage3_fused].speedup_vs_prev\"), \
               stage 0 takes [440 ms](results/a.json \"records[0].timing.median_ms\") and \
               [277.3 MiB](results/a.json \"records[stage=stage0_baseline].peak_mem_bytes\"); error \
               [1.8e-2](results/a.json \"records[1].check.rel_err\"). A [plain link](results/a.json) is not a citation.";
    let cites = find(doc);
    assert_eq!(cites.len(), 4);
    let fenced = format!("```text\n{doc}\n```\n");
    assert!(find(&fenced).is_empty(), "an example in a code block is not a citation");
    assert_eq!(cites[0].text, "1.44x");
    let j = json();
    let bad = check(doc, |_| Ok(j.clone()));
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].0.text, "440 ms");
    assert_eq!(bad[0].1, "should read 445 ms");
    let (fixed, stale) = update(doc, "results/a.json", &j);
    assert!(stale.is_empty(), "{stale:?}");
    assert!(check(&fixed, |_| Ok(j.clone())).is_empty());
    assert!(fixed.contains("[445 ms](results/a.json"), "{fixed}");
    // Another file's citations are left alone.
    assert_eq!(update(doc, "results/b.json", &j).0, doc);
}

#[test]
fn a_path_that_does_not_resolve_is_reported() {
    let doc = "[1.00x](results/a.json \"records[stage=stage9].speedup_vs_prev\")";
    let bad = check(doc, |_| Ok(json()));
    assert!(bad[0].1.contains("stage9"), "{bad:?}");
    // Updating keeps it, and says so.
    let (kept, stale) = update(doc, "results/a.json", &json());
    assert_eq!((kept.as_str(), stale.len()), (doc, 1));
}
