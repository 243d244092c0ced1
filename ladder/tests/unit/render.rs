//! Unit tests of `ladder/src/render.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn splice_touches_only_the_region() {
    let (begin, end) = markers("results");
    assert_eq!(begin, "<!-- results:begin -->");
    let readme = format!("# Title\n\nintro\n\n{begin}\nold table\nold notes\n{end}\n\n## After\ntext\n");
    let out = splice_readme(&readme, "results", "new table\n").unwrap();
    assert_eq!(out, format!("# Title\n\nintro\n\n{begin}\nnew table\n{end}\n\n## After\ntext\n"));
    assert_eq!(splice_readme(&out, "results", "new table\n").unwrap(), out, "idempotent");
    // A region without its final newline still leaves the end marker on its own line.
    assert_eq!(splice_readme(&readme, "results", "new table").unwrap(), out);
    // An empty region is allowed and keeps the markers.
    assert_eq!(splice_readme(&readme, "results", "").unwrap(), format!("# Title\n\nintro\n\n{begin}\n\n{end}\n\n## After\ntext\n"));
}

#[test]
fn regions_are_independent() {
    let (b, e) = markers("results");
    let (gb, ge) = markers("results-gpu");
    let readme = format!("{b}\ncpu\n{e}\n\n{gb}\nno GPU run yet\n{ge}\n");
    let out = splice_readme(&readme, "results-gpu", "gpu table\n").unwrap();
    assert_eq!(out, format!("{b}\ncpu\n{e}\n\n{gb}\ngpu table\n{ge}\n"));
    assert_eq!(splice_readme(&out, "results", "cpu 2\n").unwrap(), format!("{b}\ncpu 2\n{e}\n\n{gb}\ngpu table\n{ge}\n"));
    assert!(region_name("results-gpu").is_ok());
    assert!(region_name("a -->").is_err() && region_name("").is_err());
}

#[test]
fn splice_refuses_missing_duplicated_or_reversed_markers() {
    let (begin, end) = markers("results");
    let cases = [
        ("no markers\n".to_string(), "has 0 and 0"),
        (format!("{begin}\nonly begin\n"), "has 1 and 0"),
        (format!("{begin}\na\n{end}\n{begin}\nb\n{end}\n"), "has 2 and 2"),
        (format!("{end}\na\n{begin}\n"), "comes before"),
    ];
    for (readme, why) in cases {
        let e = splice_readme(&readme, "results", "x\n").unwrap_err();
        assert!(matches!(e, SpeedkitError::Usage(_)), "exit 2");
        let msg = e.to_string();
        assert!(msg.contains(why) && msg.contains("Fix:"), "{msg}");
    }
}

#[test]
fn milliseconds_keep_three_digits() {
    assert_eq!(fmt_ms(451.93), "452");
    assert_eq!(fmt_ms(21.349), "21.3");
    assert_eq!(fmt_ms(1.2345), "1.23");
    assert_eq!(fmt_ms(0.05213), "0.052");
    assert_eq!(speedup_text(None, false), "–");
    assert_eq!(speedup_text(Some(2.126), false), "2.13x");
    assert_eq!(axis_label("seq", 512), "T = 512");
}

#[test]
fn recorded_cpu_run_renders() {
    // A run recorded before the report gained its provenance fields still renders.
    let json = include_str!("../../../results/cpu-epyc-8c37a49/small.json");
    let report: LadderReport = serde_json::from_str(json).unwrap();
    let md = report.table(true);
    assert!(md.starts_with("| stage | precision | median ms (p10–p90) |"), "{md}");
    assert!(md.contains("| stage0_baseline | fp32 | 452 (429–465) | 1.00x | – |"), "{md}");
    let region = readme_region(&report, "results/cpu-epyc-8c37a49/small.json", "results/x.svg");
    assert!(region.contains("**CPU: AMD EPYC, 2 threads** · preset `small` (B=4 T=512"), "{region}");
    assert!(region.contains("commit `8c37a4920778` · 2026-11-21"), "{region}");
    assert!(region.contains("2 warm-up + 20 timed iterations"), "{region}");
    assert!(region.contains("(results/x.svg)\n"), "{region}");
    assert!(region.ends_with("(results/x-roofline.svg)\n"), "{region}");
}

#[test]
fn each_region_is_rewritten_on_its_own_page_with_links_from_there() {
    use std::path::Path;
    assert_eq!(region_page(Path::new("README.md"), "results"), (Path::new("README.md").to_path_buf(), String::new()));
    assert_eq!(region_page(Path::new("README.md"), "results-gpu"), (Path::new("README.md").to_path_buf(), String::new()));
    let (page, up) = region_page(Path::new("repo/README.md"), "results-gpu-gpt2");
    assert_eq!((page.as_path(), up.as_str()), (Path::new("repo/docs/gpu.md"), "../"));
    let (page, _) = region_page(Path::new("README.md"), "results-gpu-ablate-te");
    assert_eq!(page, Path::new("./docs/gpu.md"));
    let (page, up) = region_page(Path::new("repo/README.md"), "results-train");
    assert_eq!((page.as_path(), up.as_str()), (Path::new("repo/docs/training.md"), "../"));
    // Each summary region's full region lives on a docs page.
    for (summary, full) in SUMMARY_REGIONS {
        assert_eq!(region_page(Path::new("README.md"), summary).0, Path::new("README.md"), "{summary}");
        assert_eq!(full_region(summary), Some(full));
        assert!(DOCS_REGIONS.iter().any(|(r, _)| *r == full), "{full}");
    }
    assert_eq!(full_region("results-gpu-gpt2"), None);
}

#[test]
fn regions_take_their_own_mode_only() {
    assert_eq!(region_mode("results-train"), Mode::Train);
    assert_eq!(region_mode("results_gpu_train"), Mode::Train);
    for forward in ["results", "results-gpu", "results-trained", "trainers", "results-gpu-ablate-te"] {
        assert_eq!(region_mode(forward), Mode::Forward, "{forward}");
    }
    assert_eq!(region_mode("results-gpu-train"), Mode::Train);
    let forward_docs = DOCS_REGIONS.iter().map(|(r, _)| *r).filter(|r| region_mode(r) == Mode::Forward);
    for region in std::iter::once("results").chain(forward_docs).chain(["results-gpu"]) {
        let e = check_region_mode(region, Mode::Train, "t.json").unwrap_err().to_string();
        assert!(e.contains("t.json times training steps") && e.contains(region) && e.contains("results-train"), "{e}");
        assert!(check_region_mode(region, Mode::Forward, "t.json").is_ok());
    }
    let e = check_region_mode("results-train", Mode::Forward, "f.json").unwrap_err().to_string();
    assert!(e.contains("f.json times forwards") && e.contains("shows training steps") && e.contains("Fix:"), "{e}");
    assert!(check_region_mode("results-train", Mode::Train, "t.json").is_ok());
    assert!(check_region_mode("results-gpu-train", Mode::Train, "t.json").is_ok());
    assert!(check_region_mode("results-gpu-train", Mode::Forward, "f.json").is_err());
}

#[test]
fn a_summary_region_shows_the_table_and_links_the_rest() {
    let report: LadderReport = serde_json::from_str(include_str!("../../../results/ladder-cpu.json")).unwrap();
    let (json, svg) = ("results/ladder-cpu.json", "results/ladder-cpu.svg");
    let full = readme_region(&report, json, svg);
    let summary = region_text("results", &report, json, svg);
    assert_eq!(region_text("results-cpu", &report, json, svg), full, "a docs region shows the run in full");
    let head = summary.split("\nOne change at a time, where").next().unwrap();
    assert!(full.starts_with(head), "the summary is the full region's head:\n{summary}");
    assert!(summary.ends_with("and the roofline: [docs/measuring.md](docs/measuring.md).\n"), "{summary}");
    assert!(!summary.contains("**Where the time goes**") && full.contains("**Where the time goes**"), "{summary}");
    assert!(!summary.contains("roofline.svg") && full.contains("(results/ladder-cpu-roofline.svg)"), "{summary}");
}
