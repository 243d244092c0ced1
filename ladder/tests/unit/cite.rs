//! Unit tests of `ladder/src/cite.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

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

use super::*;

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
