//! The ladder binary end to end on `tiny`: every stage a row, JSON that parses into the report,
//! an SVG chart that is well-formed XML, a markdown table that parses, --update-readme that
//! rewrites only its region and is idempotent, sweeps, --stages, and `ladder report`.

use shared::report::{LadderReport, SweepReport, LADDER_SCHEMA, SWEEP_SCHEMA};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh temporary folder per test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("speedkit-ladder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn ok(&self) -> &Self {
        assert_eq!(self.code, Some(0), "{}{}", self.stdout, self.stderr);
        self
    }
}

fn ladder(args: &[&str]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_ladder")).args(args).output().unwrap();
    Out { code: o.status.code(), stdout: String::from_utf8_lossy(&o.stdout).into(), stderr: String::from_utf8_lossy(&o.stderr).into() }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const TINY: [&str; 6] = ["--preset", "tiny", "--warmup", "1", "--iters", "2"];

fn tiny(extra: &[&str]) -> Vec<String> {
    TINY.iter().chain(extra).map(|a| a.to_string()).collect()
}

fn run_tiny(extra: &[&str]) -> Out {
    let args = tiny(extra);
    ladder(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The stages of a report's rows, in order.
fn row_names(r: &LadderReport) -> Vec<String> {
    r.rows().iter().map(|row| row.stage().to_string()).collect()
}

fn all_stage_names() -> Vec<String> {
    ladder::default_stages().iter().map(|s| s.name().to_string()).collect()
}

/// The markdown tables in `text`: each a list of rows of cells, header first, separator
/// checked and dropped. Panics when a table is malformed (ragged rows, no separator).
fn markdown_tables(text: &str) -> Vec<Vec<Vec<String>>> {
    let mut tables = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in text.lines().chain(std::iter::once("")) {
        if line.starts_with('|') {
            current.push(line);
            continue;
        }
        if current.is_empty() {
            continue;
        }
        let cells = |l: &str| -> Vec<String> {
            assert!(l.ends_with('|'), "row does not end with |: {l}");
            // Split on unescaped pipes.
            let inner = &l[1..l.len() - 1];
            let mut out = vec![String::new()];
            let mut prev = ' ';
            for c in inner.chars() {
                if c == '|' && prev != '\\' {
                    out.push(String::new());
                } else {
                    out.last_mut().unwrap().push(c);
                }
                prev = c;
            }
            out.iter().map(|c| c.trim().to_string()).collect()
        };
        let header = cells(current[0]);
        let sep = cells(current[1]);
        assert!(sep.iter().all(|c| c.len() >= 3 && c.chars().all(|ch| ch == '-' || ch == ':')), "separator: {}", current[1]);
        assert_eq!(sep.len(), header.len(), "separator width");
        let mut table = vec![header.clone()];
        for l in &current[2..] {
            let row = cells(l);
            assert_eq!(row.len(), header.len(), "ragged row: {l}");
            table.push(row);
        }
        tables.push(table);
        current.clear();
    }
    tables
}

/// Parse an SVG as XML and return the text of its <text> elements.
fn svg_texts(path: &Path) -> Vec<String> {
    let svg = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{} is not well-formed XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).map(|t| t.trim().to_string()).collect()
}

#[test]
fn ladder_end_to_end_on_tiny() {
    let dir = temp_dir("e2e");
    let (json, svg) = (dir.join("ladder.json"), dir.join("ladder.svg"));
    let o = run_tiny(&["--json", s(&json), "--svg", s(&svg)]);
    o.ok();
    assert!(o.stdout.contains("vs stage 0") && o.stdout.contains("stage0_baseline"), "{}", o.stdout);

    // JSON: the report, every stage a row (run or skipped), and where it ran.
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report.schema, LADDER_SCHEMA);
    assert_eq!(row_names(&report), all_stage_names(), "every stage in stages() is a row, run or skipped");
    assert_eq!(report.stages, all_stage_names());
    assert_eq!(report.args, tiny(&["--json", s(&json), "--svg", s(&svg)]));
    assert_eq!(report.shape, shared::Preset::Tiny.shape());
    assert!(report.versions["candle-core"].starts_with("0.11."), "{:?}", report.versions);
    assert_eq!(report.versions["candle-speedkit"], env!("CARGO_PKG_VERSION"));
    assert!(!report.commit.is_empty());
    // A CPU run says nothing about a GPU driver, rather than inventing one.
    assert_eq!((report.cuda_driver_version.as_deref(), report.nvidia_driver.as_deref()), (None, None));
    let s0 = &report.records[0];
    assert_eq!(s0.stage, "stage0_baseline");
    assert_eq!(s0.speedup_vs_stage0, Some(1.0));
    assert_eq!(s0.timing.samples_ms.len(), 2);
    assert!(s0.check.as_ref().unwrap().passed);
    for r in &report.records[1..] {
        assert!(r.speedup_vs_stage0.is_some(), "{}", r.stage);
    }

    // SVG: well-formed, one slot per stage with its name, a speedup on every measured bar, and
    // the error (or why not measured) under every slot.
    let texts = svg_texts(&svg);
    for name in all_stage_names() {
        assert!(texts.contains(&name), "{name} not labelled in the chart: {texts:?}");
    }
    // A speedup is "1.49x", or "≈1.0x" when within noise.
    let speedups = texts
        .iter()
        .filter(|t| t.ends_with('x') && t.trim_start_matches('≈')[..t.trim_start_matches('≈').len() - 1].parse::<f64>().is_ok())
        .count();
    assert_eq!(speedups, report.records.len(), "{texts:?}");
    let errors = texts.iter().filter(|t| t.starts_with("rel err ") || *t == "not measured" || *t == "failed its check").count();
    assert_eq!(errors, all_stage_names().len(), "{texts:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn breakdown_ablation_noise_and_roofline_end_to_end_on_tiny() {
    let dir = temp_dir("attrib");
    let (json, svg) = (dir.join("ladder.json"), dir.join("ladder.svg"));
    let o = run_tiny(&["--breakdown", "--ablate", "--rounds", "2", "--bandwidth-gbs", "20", "--json", s(&json), "--svg", s(&svg)]);
    o.ok();
    assert!(o.stdout.contains("where the time goes") && o.stdout.contains("one change at a time"), "{}", o.stdout);
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report.rounds, Some(2));

    // Breakdown: every stage, its parts in forward order, named as the stage fuses them.
    for r in &report.records {
        let b = r.breakdown.as_ref().unwrap_or_else(|| panic!("{} has no breakdown", r.stage));
        let names: Vec<&str> = b.parts.iter().map(|p| p.name.as_str()).collect();
        let expected: Vec<&str> = match r.stage.as_str() {
            "stage3_fused" | "stage4_fp8" => vec!["ln1", "qkv", "attention", "proj+residual+ln2", "fc1+gelu", "fc2+residual"],
            _ => shared::breakdown::PARTS.to_vec(),
        };
        assert_eq!(names, expected, "{}", r.stage);
        assert_eq!(b.iters, 2, "one instrumented iteration per timed one, over both rounds: {}", r.stage);
        assert!(b.total_ms > 0.0 && b.method.starts_with("instrumented"), "{b:?}");
        // Two rounds of one iteration each, pooled.
        assert_eq!(r.timing.samples_ms.len(), 2, "{}", r.stage);
    }

    // Ablation: stage 0 on candle's element-wise ops (what the engine's passes buy every stage),
    // stage 2 with its copies kept and with its row-wise CPU kernel, stage 3 without each fusion
    // (its slow twin on the same engine), stage 4 without each of its FP8 producer fusions, each
    // measured and checked, each priced against the stage as written.
    let changes: Vec<(&str, &str)> = report.ablation.iter().map(|a| (a.against.as_str(), a.change.as_str())).collect();
    assert_eq!(
        changes,
        [
            ("stage0_baseline", "candle's element-wise ops"),
            ("stage2_sdpa", "head split/merge copies kept"),
            ("stage2_sdpa", "row-wise online softmax, no register tiles"),
            ("stage3_fused", "without ln"),
            ("stage3_fused", "without qkv"),
            ("stage3_fused", "without epilogue"),
            ("stage3_fused", "without add-ln"),
            ("stage4_fp8", "without fp8 ln"),
            ("stage4_fp8", "without fp8 fc1"),
        ]
    );
    for a in &report.ablation {
        assert!(a.record.check.as_ref().unwrap().passed, "{}", a.change);
        let full = report.records.iter().find(|r| r.stage == a.against).unwrap();
        let ratio = a.record.timing.median_ms / full.timing.median_ms;
        assert!(a.buys.is_some_and(|b| (b - ratio).abs() < 1e-9 * ratio), "{:?} vs {ratio}", a.buys);
        assert_eq!(a.buys_within_noise, shared::report::overlaps(&a.record.timing, &full.timing));
        assert_eq!(a.record.variant.as_deref(), Some(a.change.as_str()));
    }

    // Noise: a flag exactly when the p10–p90 intervals overlap, and "≈1.0x" in the markdown then.
    let s0 = &report.records[0];
    for r in &report.records[1..] {
        assert_eq!(r.noise_vs_stage0, shared::report::overlaps(&s0.timing, &r.timing), "{}", r.stage);
    }
    let md = ladder(&["render", "--from", s(&json), "--markdown"]);
    md.ok();
    let tables = markdown_tables(&md.stdout);
    assert_eq!(tables.len(), 3, "rows, ablation, breakdown: {}", md.stdout);
    for (row, r) in tables[0][1..].iter().zip(&report.records) {
        assert_eq!(row[3] == "≈1.0x", r.noise_vs_stage0, "{row:?}");
    }
    assert_eq!(tables[1].len(), 1 + report.ablation.len());
    assert_eq!(tables[2].len(), 1 + report.records.len());

    // The charts beside the bar chart: roofline (a point per stage, the bandwidth ceiling) and
    // the stacked breakdown, both from the same JSON.
    let roof = svg_texts(&dir.join("ladder-roofline.svg"));
    for r in &report.records {
        assert!(roof.iter().any(|t| t.starts_with(&r.stage)), "{} not on the roofline: {roof:?}", r.stage);
    }
    assert!(roof.iter().any(|t| t == "memory 20 GB/s"), "{roof:?}");
    // On the CPU the roof is the measured GEMM rate (the probe ran when the session opened),
    // drawn once per precision measured: fp32, and bf16 where a bf16 unit ran the bf16 rows;
    // the emulated FP8 stage gets no roof of its own.
    let roofs: Vec<&String> = roof.iter().filter(|t| t.contains(" peak ") && t.ends_with("GFLOP/s")).collect();
    let bf16_unit = cpu_kernels::bf16_gemm::Kernel::detect().is_native();
    assert_eq!(roofs.len(), 1 + bf16_unit as usize, "{roof:?}");
    assert!(roofs.iter().any(|r| r.starts_with("fp32")) && !roofs.iter().any(|r| r.contains("fp8")), "{roofs:?}");
    assert_eq!(roofs.iter().any(|r| r.starts_with("bf16")), bf16_unit, "{roofs:?}");
    assert!(report.ceilings.as_ref().is_some_and(|c| c.source.contains("measured")), "{:?}", report.ceilings);
    let bars = svg_texts(&dir.join("ladder-breakdown.svg"));
    assert!(bars.iter().any(|t| t == "proj+residual+ln2") && bars.iter().any(|t| t == "attention"), "{bars:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn ablate_with_sweep_is_refused() {
    let o = run_tiny(&["--ablate", "--sweep", "seq=32,64"]);
    assert_eq!(o.code, Some(2), "{}{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("--ablate") && o.stderr.contains("Fix"), "{}", o.stderr);
}

#[test]
fn markdown_table_parses_with_a_row_per_stage() {
    let o = run_tiny(&["--markdown"]);
    o.ok();
    let tables = markdown_tables(&o.stdout);
    assert_eq!(tables.len(), 1, "{}", o.stdout);
    let t = &tables[0];
    assert_eq!(t[0][..4], ["stage", "precision", "median ms (p10–p90)", "vs stage 0"]);
    let names: Vec<String> = t[1..].iter().map(|r| r[0].clone()).collect();
    assert_eq!(names, all_stage_names());
    assert_eq!(t[1][3], "1.00x", "stage 0 against itself");
    for row in &t[1..] {
        let measured = !row[1].starts_with("skipped") && !row[1].starts_with("FAILED");
        if measured {
            let median: f64 = row[2].split(' ').next().unwrap().parse().unwrap();
            assert!(median > 0.0, "{row:?}");
        }
    }
}

#[test]
fn stages_selects_rows_and_speedups_need_stage_0() {
    let dir = temp_dir("stages");
    let json = dir.join("l.json");
    let o = run_tiny(&["--stages", "3,1", "--json", s(&json)]);
    o.ok();
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(row_names(&report), ["stage1_tensorcore", "stage3_fused"], "ladder order, whatever order given");
    for r in &report.records {
        assert_eq!(r.speedup_vs_stage0, None, "no stage 0, no speedup over it: {}", r.stage);
        assert_eq!(r.speedup_vs_prev, None, "stage 2 did not run, so stage 3 has no 'previous': {}", r.stage);
    }
    assert!(o.stdout.contains("stage 0 was not selected"), "{}", o.stdout);

    let o = run_tiny(&["--stages", "0,1", "--json", s(&json)]);
    o.ok();
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(report.records[1].speedup_vs_prev.is_some());

    let n = ladder::STAGES.len();
    let o = run_tiny(&["--stages", &format!("0,{n}")]);
    assert_eq!(o.code, Some(2), "{}{}", o.stdout, o.stderr);
    assert!(o.stderr.contains(&format!("names stage {n}")) && o.stderr.contains("0 stage0_baseline"), "{}", o.stderr);
    assert!(!o.stdout.contains("ran "), "refused before running anything: {}", o.stdout);
    std::fs::remove_dir_all(&dir).ok();
}

/// A README with text before, between and after the markers.
fn fixture_readme() -> (String, String) {
    let before = "# Title\n\nSome text | with a pipe.\n\n## Results\n\n<!-- results:begin -->\n";
    let after = "<!-- results:end -->\n\nReading it: notes a person wrote.\n\n## Later\n\nmore\n";
    (before.into(), after.into())
}

#[test]
fn update_readme_rewrites_only_its_region_and_is_idempotent() {
    let dir = temp_dir("readme");
    let readme = dir.join("README.md");
    let (before, after) = fixture_readme();
    std::fs::write(&readme, format!("{before}hand-made table\n{after}")).unwrap();

    let o = run_tiny(&["--update-readme", "--readme", s(&readme)]);
    o.ok();
    let text = std::fs::read_to_string(&readme).unwrap();
    assert!(text.starts_with(&before) && text.ends_with(&after), "outside the markers untouched:\n{text}");
    let region = &text[before.len()..text.len() - after.len()];
    assert!(!region.contains("hand-made"), "{region}");
    assert!(region.contains("**CPU: ") && region.contains("preset `tiny`") && region.contains("commit `"), "{region}");
    assert!(region.contains("data: [results/ladder-cpu.json](results/ladder-cpu.json)"), "{region}");
    assert!(region.contains("](results/ladder-cpu.svg)"), "{region}");
    let tables = markdown_tables(region);
    assert_eq!(tables.len(), 1);
    assert_eq!(tables[0].len() - 1, ladder::STAGES.len());
    let (json, svg) = (dir.join("results/ladder-cpu.json"), dir.join("results/ladder-cpu.svg"));
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(row_names(&report), all_stage_names());
    svg_texts(&svg);
    let svg_bytes = std::fs::read(&svg).unwrap();

    // Rendering the recorded run again changes nothing: not the README, not the chart.
    let o = ladder(&["render", "--from", s(&json), "--update-readme", "--readme", s(&readme)]);
    o.ok();
    assert!(o.stdout.contains("unchanged"), "{}", o.stdout);
    assert_eq!(std::fs::read_to_string(&readme).unwrap(), text, "idempotent");
    assert_eq!(std::fs::read(&svg).unwrap(), svg_bytes, "the chart is a function of the JSON");

    // From a README whose region holds something else, render restores the same bytes.
    std::fs::write(&readme, format!("{before}stale\n{after}")).unwrap();
    ladder(&["render", "--from", s(&json), "--update-readme", "--readme", s(&readme)]).ok();
    assert_eq!(std::fs::read_to_string(&readme).unwrap(), text);

    // Another named region (a GPU run's, say) is written without touching this one.
    let gpu = "<!-- results-gpu:begin -->\nNo GPU run recorded yet.\n<!-- results-gpu:end -->\n";
    std::fs::write(&readme, format!("{text}{gpu}")).unwrap();
    ladder(&["render", "--from", s(&json), "--update-readme", "--readme", s(&readme), "--readme-region", "results-gpu"]).ok();
    let both = std::fs::read_to_string(&readme).unwrap();
    assert!(both.starts_with(&text) && !both.contains("No GPU run"), "{both}");
    assert_eq!(markdown_tables(&both).len(), 2);

    // A region that lives on docs/gpu.md (`render::DOCS_REGIONS`) is written there, with links
    // from that page, and the README is left alone.
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    let page = "# GPU\n\n<!-- results-gpu-gpt2:begin -->\nold\n<!-- results-gpu-gpt2:end -->\n";
    std::fs::write(dir.join("docs/gpu.md"), page).unwrap();
    let o = ladder(&["render", "--from", s(&json), "--update-readme", "--readme", s(&readme), "--readme-region", "results-gpu-gpt2"]);
    o.ok();
    let docs = std::fs::read_to_string(dir.join("docs/gpu.md")).unwrap();
    assert!(!docs.contains("\nold\n") && docs.contains("data: [../results/ladder-cpu.json](../results/ladder-cpu.json)"), "{docs}");
    assert!(docs.contains("](../results/ladder-cpu.svg)"), "{docs}");
    assert_eq!(std::fs::read_to_string(&readme).unwrap(), both, "the README holds no such region and is not touched");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn update_readme_refuses_bad_markers_before_running() {
    let dir = temp_dir("markers");
    let readme = dir.join("README.md");
    for bad in ["# no markers\n", "<!-- results:begin -->\na\n<!-- results:end -->\n<!-- results:begin -->\n<!-- results:end -->\n"] {
        std::fs::write(&readme, bad).unwrap();
        let o = run_tiny(&["--update-readme", "--readme", s(&readme)]);
        assert_eq!(o.code, Some(2), "{}{}", o.stdout, o.stderr);
        assert!(o.stderr.contains("exactly one") && o.stderr.contains("Fix:"), "{}", o.stderr);
        assert!(!o.stdout.contains("ran "), "refused before running: {}", o.stdout);
        assert_eq!(std::fs::read_to_string(&readme).unwrap(), bad, "untouched");
    }
    let o = run_tiny(&["--update-readme", "--readme", s(&dir.join("missing.md"))]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("cannot read"), "{}", o.stderr);
    // A sweep is several runs; the README region holds one.
    std::fs::write(&readme, "<!-- results:begin -->\n<!-- results:end -->\n").unwrap();
    let o = run_tiny(&["--update-readme", "--readme", s(&readme), "--sweep", "seq=8,16"]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("a sweep is several"), "{}", o.stderr);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sweep_gives_a_table_per_value_a_summary_and_a_chart() {
    let dir = temp_dir("sweep");
    let (json, svg) = (dir.join("sweep.json"), dir.join("sweep.svg"));
    let o = run_tiny(&["--sweep", "seq=8,16", "--markdown", "--json", s(&json), "--svg", s(&svg)]);
    o.ok();
    let sweep: SweepReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(sweep.schema, SWEEP_SCHEMA);
    assert_eq!((sweep.axis.as_str(), sweep.values.clone()), ("seq", vec![8, 16]));
    for (run, t) in sweep.runs.iter().zip([8, 16]) {
        assert_eq!(run.shape.seq, t);
        assert_eq!(row_names(run), all_stage_names());
    }
    let tables = markdown_tables(&o.stdout);
    assert_eq!(tables.len(), 3, "one per value and the summary: {}", o.stdout);
    let summary = &tables[2];
    assert_eq!(summary[0], ["stage", "T = 8", "T = 16"]);
    assert_eq!(summary.len() - 1, ladder::STAGES.len());
    assert!(summary[1][1].ends_with("1.00x"), "{:?}", summary[1]);
    let texts = svg_texts(&svg);
    assert!(texts.iter().any(|t| t.starts_with("Sweep over T")), "{texts:?}");
    assert!(texts.contains(&"8".to_string()) && texts.contains(&"16".to_string()), "{texts:?}");

    // `render` reproduces the sweep's tables from its JSON.
    let r = ladder(&["render", "--from", s(&json), "--markdown"]);
    r.ok();
    assert_eq!(markdown_tables(&r.stdout), tables);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sweep_value_that_cannot_run_is_skipped_rows_not_a_crash() {
    let dir = temp_dir("sweep-skip");
    let json = dir.join("sweep.json");
    // tiny has d_head = 32: C = 100 cannot keep it; C = 64 can (n_head 2, FF 256).
    let o = run_tiny(&["--sweep", "d_model=100,64", "--json", s(&json)]);
    o.ok();
    let sweep: SweepReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let (bad, good) = (&sweep.runs[0], &sweep.runs[1]);
    assert!(bad.records.is_empty());
    assert_eq!(row_names(bad), all_stage_names());
    assert!(bad.skipped.iter().all(|s| !s.failed && s.reason.contains("C = 100") && s.reason.contains("d_head = 32")), "{:?}", bad.skipped);
    assert_eq!((good.shape.d_model, good.shape.n_head, good.shape.ff), (64, 2, 256));
    assert!(!good.records.is_empty());
    assert!(o.stdout.contains("skipped"), "{}", o.stdout);

    let o = run_tiny(&["--sweep", "seq=8", "--seq", "8"]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("both set the same dimension"), "{}", o.stderr);
    let o = run_tiny(&["--sweep", "heads=2"]);
    assert_eq!(o.code, Some(2), "a clap error is exit 2 too");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn render_refuses_what_is_not_a_ladder_json() {
    let dir = temp_dir("render");
    let record = dir.join("record.json");
    std::fs::write(&record, r#"{"schema": "candle-speedkit/record/v1"}"#).unwrap();
    let o = ladder(&["render", "--from", s(&record)]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("one stage's record"), "{}", o.stderr);
    std::fs::write(&record, "not json").unwrap();
    let o = ladder(&["render", "--from", s(&record)]);
    assert_eq!(o.code, Some(2));
    assert!(o.stderr.contains("is not a ladder JSON file"), "{}", o.stderr);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn report_lists_every_stage_with_its_reason() {
    let o = ladder(&["report", "--preset", "tiny"]);
    o.ok();
    assert!(o.stdout.contains("switches  now: TF32 off"), "{}", o.stdout);
    for spec in ladder::default_stages() {
        assert!(o.stdout.contains(spec.name()), "{} missing:\n{}", spec.name(), o.stdout);
    }
    let why = if cpu_kernels::bf16_gemm::Kernel::detect().is_native() {
        "auto on CPU: bf16 GEMMs on this CPU's"
    } else {
        "auto on CPU: no bf16 units"
    };
    assert!(o.stdout.contains(why), "{}", o.stdout);
    // An override the device cannot do is reported per stage, not a crash.
    let o = ladder(&["report", "--preset", "tiny", "--precision", "tf32"]);
    o.ok();
    assert!(o.stdout.contains("stage1_tensorcore  skipped: --precision tf32 cannot run"), "{}", o.stdout);
}

#[test]
fn report_knows_which_stages_need_the_score_matrix() {
    // T = 100 000: a 4·10¹⁰-element score matrix. Stages 0-1 cannot run it; stage 2 never
    // builds that matrix, so the report must not refuse it for that.
    let o = ladder(&["report", "--preset", "tiny", "--seq", "100000"]);
    o.ok();
    let stdout = &o.stdout;
    let block = |stage: &str| -> String {
        let start = stdout.find(stage).unwrap();
        let rest = &stdout[start + stage.len()..];
        let end = rest.find("\n  stage").unwrap_or(rest.len());
        rest[..end].to_string()
    };
    assert!(block("stage0_baseline").contains("cannot run this shape"), "{stdout}");
    assert!(block("stage1_tensorcore").contains("cannot run this shape"), "{stdout}");
    assert!(!block("stage2_sdpa").contains("cannot run this shape"), "{stdout}");
}

/// `ladder report` predicts what the run does with a stage flag this device cannot honour:
/// stages 2-4 skipped with the reason, stages 0-1 planned.
#[test]
fn report_predicts_a_refused_stage_flag() {
    let o = ladder(&["report", "--preset", "tiny", "--attention-kernel", "v1"]);
    o.ok();
    for stage in ["stage2_sdpa", "stage3_fused", "stage4_fp8"] {
        assert!(o.stdout.contains(&format!("{stage:<18} skipped: --attention-kernel v1")), "{stage}:\n{}", o.stdout);
    }
    assert!(!o.stdout.contains("stage1_tensorcore  skipped"), "{}", o.stdout);
}

/// `--reference`: the candle-nn block is timed in the same rounds, checked against the same
/// reference output, and every row carries its speed against the fastest reference row; the
/// markdown table marks the reference row and shows the column.
#[test]
fn reference_rows_are_checked_timed_and_compared() {
    let dir = temp_dir("reference");
    let json = dir.join("r.json");
    let o = run_tiny(&["--stages", "0,2", "--reference", "--markdown", "--json", s(&json)]);
    o.ok();
    let r: LadderReport = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r.references.len(), 1, "{:?}", r.references_out);
    let reference = &r.references[0];
    assert_eq!(reference.stage, "candle-nn ops");
    assert!(reference.check.as_ref().is_some_and(|c| c.passed), "{:?}", reference.check);
    assert_eq!(reference.vs_reference, Some(1.0), "the only reference is the best one");
    for rec in &r.records {
        let want = reference.timing.median_ms / rec.timing.median_ms;
        assert!(rec.vs_reference.is_some_and(|v| (v - want).abs() < 1e-12), "{}: {:?} vs {want}", rec.stage, rec.vs_reference);
    }
    assert!(o.stdout.contains("| reference: candle-nn ops |") && o.stdout.contains("vs best reference"), "{}", o.stdout);
    // Without the flag: no reference row, no column.
    let o = run_tiny(&["--stages", "0", "--markdown"]);
    assert!(!o.ok().stdout.contains("reference"), "{}", o.stdout);
    std::fs::remove_dir_all(&dir).ok();
}

/// A run with PyTorch's rows merged in by scripts/torch-reference.py (a real run at `tiny`,
/// kept as a fixture: CI has no PyTorch) loads and renders: the script writes the ladder's schema.
#[test]
fn torch_reference_rows_render() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch-reference-tiny.json");
    let o = ladder(&["render", "--from", fixture, "--markdown"]);
    o.ok();
    for row in ["| reference: candle-nn ops |", "| reference: pytorch eager |", "| reference: pytorch compile bf16 |"] {
        assert!(o.stdout.contains(row), "{row} missing:\n{}", o.stdout);
    }
    let r: LadderReport = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let best = r.references.iter().map(|x| x.timing.median_ms).fold(f64::INFINITY, f64::min);
    for rec in r.records.iter().chain(&r.references) {
        assert!(rec.vs_reference.is_some_and(|v| (v - best / rec.timing.median_ms).abs() < 1e-9), "{}", rec.stage);
    }
}

/// `--train`: every row a training step (mode "train", the update and the gradient check beside
/// it), a stage without a backward a skipped row naming why; the JSON renders back with the
/// training columns, and a forward-only file from before `mode` (schema v1) still renders.
#[test]
fn train_rows_are_checked_steps_and_render_back() {
    let dir = temp_dir("train");
    let json = dir.join("train.json");
    let out = ladder(&[&TINY[..], &["--stages", "0,3", "--train", "--breakdown", "--json", s(&json)]].concat());
    let report: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report.schema, LADDER_SCHEMA);
    for r in &report.records {
        assert_eq!(r.mode, shared::report::Mode::Train, "{}", r.stage);
        let t = r.train.as_ref().expect("a training row has its training facts");
        assert!(t.grad_check.as_ref().is_some_and(|c| c.passed) && t.optimizer_check.as_ref().is_some_and(|c| c.passed), "{t:?}");
        let b = r.breakdown.as_ref().unwrap();
        let parts: Vec<&str> = b.parts.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(parts, ["forward", "backward"]);
        // The backward by part: the forward's parts in reverse, then the update; each sample's
        // parts add up to no more than that step's whole backward (they tile it).
        let names: Vec<&str> = b.backward.iter().map(|p| p.name.as_str()).collect();
        let want: &[&str] = match r.stage.as_str() {
            "stage0_baseline" => &["fc2+residual", "fc1+gelu", "ln2", "proj+residual", "attention", "qkv", "ln1", "optimizer"],
            _ => &["fc2+residual", "fc1+gelu", "proj+residual+ln2", "attention", "qkv", "ln1", "optimizer"],
        };
        assert_eq!(names, want, "{}", r.stage);
        for (i, whole) in b.parts[1].samples_ms.iter().enumerate() {
            let sum: f64 = b.backward.iter().filter(|p| p.name != "optimizer").map(|p| p.samples_ms[i]).sum();
            assert!(sum <= whole + 0.5 && sum > 0.0, "{}: backward parts {sum} ms vs the backward {whole} ms", r.stage);
        }
        assert!(b.backward.iter().all(|p| p.regime.is_some()), "{}: every backward part has its regime", r.stage);
        // Each part's backward names the kernels it ran: stage 3's linears their backward GEMMs,
        // its attention FlashAttention-2's backward, its LayerNorms their one pass.
        if r.stage == "stage3_fused" {
            let ran = |name: &str| b.backward.iter().find(|p| p.name == name).unwrap().kernels.join("; ");
            for (part, kernel) in [
                ("fc2+residual", "linear backward"),
                ("fc1+gelu", "bias+gelu backward: one pass"),
                ("attention", "attention backward: FlashAttention-2 tiles"),
                ("ln1", "layer_norm backward: one pass"),
                ("optimizer", "fused AdamW"),
            ] {
                assert!(ran(part).contains(kernel), "stage 3's {part} backward ran {:?}, not {kernel}", ran(part));
            }
        }
    }
    // A stage with no training step is a row saying so, never a forward under a training label.
    for s in &report.skipped {
        assert!(s.reason.contains("no training step") && !s.failed, "{s:?}");
    }
    assert_eq!(report.records.len() + report.skipped.len(), 2, "{}{}", out.stdout, out.stderr);
    let md = ladder(&["render", "--from", s(&json), "--markdown"]);
    assert!(md.ok().stdout.contains("forward + backward ms") && md.stdout.contains("worst grad error"), "{}", md.stdout);
    // Training reference rows (scripts/torch-reference.py's) bring "vs best reference", as in a forward table.
    let mut with_ref: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let mut pytorch = with_ref["records"][0].clone();
    (pytorch["stage"], pytorch["vs_reference"]) = ("pytorch eager".into(), 1.0.into());
    with_ref["references"] = serde_json::json!([pytorch]);
    with_ref["records"].as_array_mut().unwrap().iter_mut().for_each(|r| r["vs_reference"] = 1.0.into());
    let ref_path = dir.join("train-ref.json");
    std::fs::write(&ref_path, serde_json::to_vec(&with_ref).unwrap()).unwrap();
    let md = ladder(&["render", "--from", s(&ref_path), "--markdown"]);
    let tables = markdown_tables(&md.ok().stdout);
    let header = &tables[0][0];
    let (vs_ref, grad) = (header.iter().position(|h| h == "vs best reference"), header.iter().position(|h| h == "worst grad error"));
    assert!(vs_ref.is_some() && grad.is_some(), "{header:?}");
    let row = tables[0].iter().find(|r| r[0] == "reference: pytorch eager").expect("the reference row");
    assert_eq!(row[vs_ref.unwrap()], "1.00x", "{row:?}");
    let mut old: serde_json::Value = serde_json::from_slice(&std::fs::read("../results/ladder-cpu.json").unwrap()).unwrap();
    old["schema"] = "candle-speedkit/ladder/v1".into();
    old["records"].as_array_mut().unwrap().iter_mut().for_each(|r| _ = r.as_object_mut().unwrap().remove("mode"));
    let v1_path = dir.join("v1.json");
    std::fs::write(&v1_path, serde_json::to_vec(&old).unwrap()).unwrap();
    let v1 = ladder(&["render", "--from", s(&v1_path), "--markdown"]);
    assert!(v1.ok().stdout.contains("median ms (p10–p90)") && !v1.stdout.contains("optimizer ms"), "{}", v1.stdout);
}

/// `--train --save-output`: beside x and y_<stage>, the upstream gradient `r` the loss used and
/// stage 0's 13 reference gradients as `grad_<name>` in `BlockWeights`' layout (what
/// scripts/torch-reference.py checks PyTorch's gradients against); a forward run's file holds x
/// and the outputs only.
#[test]
fn train_save_output_holds_r_and_the_reference_gradients() {
    let dir = temp_dir("train-io");
    let (train_io, forward_io) = (dir.join("train-io.safetensors"), dir.join("forward-io.safetensors"));
    run_tiny(&["--stages", "0", "--train", "--seed", "7", "--save-output", s(&train_io)]).ok();
    let saved = candle_core::safetensors::load(&train_io, &candle_core::Device::Cpu).unwrap();
    let shared::Shape { batch: b, seq: t, d_model: c, ff, .. } = shared::Preset::Tiny.shape();
    let want: [&[usize]; 13] = [&[c], &[c], &[3 * c, c], &[3 * c], &[c, c], &[c], &[c], &[c], &[ff, c], &[ff], &[c, ff], &[c], &[b, t, c]];
    let mut names: Vec<String> = ["x", "y_stage0_baseline", "r"].map(String::from).to_vec();
    for (name, dims) in shared::train::NAMES.iter().zip(want) {
        let g = &saved[&format!("grad_{name}")];
        assert_eq!(g.dims(), dims, "grad_{name}");
        assert!(g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "grad_{name} is all zeros");
        names.push(format!("grad_{name}"));
    }
    let mut keys: Vec<String> = saved.keys().cloned().collect();
    keys.sort();
    names.sort();
    assert_eq!(keys, names);
    // r is the ladder's own: `train::upstream` of the saved x at the run's seed, bit for bit.
    let r = shared::train::upstream(&saved["x"], 7).unwrap();
    assert_eq!(saved["r"].dims(), [b, t, c]);
    let diff = (&saved["r"] - &r).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(diff, 0.0);

    run_tiny(&["--stages", "0", "--save-output", s(&forward_io)]).ok();
    let forward = candle_core::safetensors::load(&forward_io, &candle_core::Device::Cpu).unwrap();
    let mut keys: Vec<&str> = forward.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["x", "y_stage0_baseline"]);
}
