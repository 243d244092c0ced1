//! The ladder as text for readers: the GitHub-markdown table, the README's results region, the
//! splice that puts that region between the README's markers, and the sweep tables.

use crate::provenance::date_utc;
use shared::report::{fmt_bytes, LadderReport, Record, Row, SweepReport};
use shared::{Preset, Shape, SpeedkitError};

/// The two lines a README region named `name` lies between (`<!-- results:begin -->` and
/// `<!-- results:end -->` for the default region); `--update-readme` rewrites what is between
/// them and nothing else.
pub fn markers(name: &str) -> (String, String) {
    (format!("<!-- {name}:begin -->"), format!("<!-- {name}:end -->"))
}

/// `--readme-region`: letters, digits, '-' and '_', so the name cannot break the comment.
pub fn region_name(s: &str) -> Result<String, String> {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        Ok(s.to_string())
    } else {
        Err(format!("'{s}' is not a region name; use letters, digits, '-' and '_', e.g. results-gpu"))
    }
}

/// Milliseconds to about three significant digits: "452", "21.3", "1.23", "0.052".
pub fn fmt_ms(ms: f64) -> String {
    match ms {
        m if m >= 100.0 => format!("{m:.0}"),
        m if m >= 10.0 => format!("{m:.1}"),
        m if m >= 1.0 => format!("{m:.2}"),
        m => format!("{m:.3}"),
    }
}

/// "2.13x", or "–" when there is nothing to compare with.
pub fn fmt_speedup(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.2}x"))
}

/// A speedup, or "≈1.0x" when its p10–p90 interval overlaps the compared row's (the measured
/// ratio stays in the JSON).
pub fn fmt_speedup_noise(v: Option<f64>, within_noise: bool) -> String {
    match v {
        Some(_) if within_noise => "≈1.0x".into(),
        v => fmt_speedup(v),
    }
}

/// `ladder --ablate`'s table: each variant, its time, and what the undone technique buys
/// (variant median over the stage's; "≈1.0x" within noise).
pub fn ablation_markdown(report: &LadderReport) -> String {
    let header: Vec<String> =
        ["stage", "undone", "median ms (p10–p90)", "stage as written", "what it buys"].iter().map(|s| s.to_string()).collect();
    let rows: Vec<Vec<String>> = report
        .ablation
        .iter()
        .map(|a| {
            let t = &a.record.timing;
            let full = report.records.iter().find(|r| r.stage == a.against);
            vec![
                a.against.clone(),
                a.change.clone(),
                format!("{} ({}–{})", fmt_ms(t.median_ms), fmt_ms(t.p10_ms), fmt_ms(t.p90_ms)),
                full.map_or("–".into(), |r| format!("{} ms", fmt_ms(r.timing.median_ms))),
                fmt_speedup_noise(a.buys, a.buys_within_noise),
            ]
        })
        // A variant that did not run is a row too, with why (in the timing column).
        .chain(
            report
                .ablation_out
                .iter()
                .map(|o| vec![o.against.clone(), o.change.clone(), not_measured(o.failed, &o.reason), "–".into(), "–".into()]),
        )
        .collect();
    md_table(&header, &rows)
}

/// What the tags in the breakdown's cells mean (`shared::regime`).
pub const REGIME_LEGEND: &str = "Each cell: ms · regime. **C** compute-bound (% of the measured GEMM rate), **M** memory-bound \
(% of the memory roof, counting the bytes the part must move at least), **O** overhead: under 30 % of the roof its \
FLOPs per byte put it under, so neither roof explains the time (extra passes, launches, scalar code). The JSON holds each \
part's FLOPs, minimum bytes, GFLOP/s and GB/s.";

/// `--breakdown`'s table: one row per stage, one column per part name (in forward order, fused
/// parts where their first part is), then the instrumented total and the uninstrumented median.
pub fn breakdown_markdown(report: &LadderReport) -> String {
    let (header, rows) = breakdown_grid(report);
    md_table(&header, &rows)
}

/// The breakdown table for the terminal.
pub fn breakdown_text(report: &LadderReport) -> String {
    let (header, rows) = breakdown_grid(report);
    aligned(&header, &rows)
}

/// The ablation table for the terminal.
pub fn ablation_text(report: &LadderReport) -> String {
    let md = ablation_markdown(report);
    let mut lines = md.lines().filter(|l| !l.starts_with("|-") && !l.starts_with("| -") && !l.starts_with("|--"));
    let parse = |l: &str| l.trim().trim_matches('|').split('|').map(|c| c.trim().to_string()).collect::<Vec<_>>();
    let header = lines.next().map(parse).unwrap_or_default();
    let rows: Vec<Vec<String>> = lines.map(parse).collect();
    aligned(&header, &rows)
}

fn breakdown_grid(report: &LadderReport) -> (Vec<String>, Vec<Vec<String>>) {
    let with: Vec<&Record> = report.records.iter().filter(|r| r.breakdown.is_some()).collect();
    let mut parts: Vec<String> = Vec::new();
    for r in &with {
        for p in &r.breakdown.as_ref().expect("filtered").parts {
            if !parts.contains(&p.name) {
                parts.push(p.name.clone());
            }
        }
    }
    let order = |name: &str| shared::breakdown::PARTS.iter().position(|p| name.starts_with(p)).unwrap_or(usize::MAX);
    parts.sort_by_key(|p| order(p)); // stable: a fused part sits after its first part's own column
    let mut header = vec!["stage".to_string()];
    header.extend(parts.iter().map(|p| format!("{p} ms")));
    header.push("total (instrumented)".into());
    header.push("median (uninstrumented)".into());
    let bandwidth = report.ceilings.as_ref().and_then(|c| c.bandwidth_gbs);
    let rows = with
        .iter()
        .map(|r| {
            // Recomputed from the validated times, shape and ceilings rather than read from the
            // file (older files have none; a file's own figures are not trusted for display).
            let mut r = (*r).clone();
            shared::regime::annotate(&mut r, bandwidth);
            let b = r.breakdown.as_ref().expect("filtered");
            let cell = |p: &shared::breakdown::PartTime| match &p.regime {
                Some(g) => format!("{} · {}", fmt_ms(p.median_ms), shared::regime::tag(g)),
                None => fmt_ms(p.median_ms),
            };
            let mut row = vec![r.stage.clone()];
            row.extend(parts.iter().map(|name| b.parts.iter().find(|p| &p.name == name).map_or("–".into(), cell)));
            row.push(format!("{} ms", fmt_ms(b.total_ms)));
            row.push(format!("{} ms", fmt_ms(r.timing.median_ms)));
            row
        })
        .collect();
    (header, rows)
}

/// The precision as the tables show it: "bf16", or "fp8 (emulated)" when the stage says which
/// implementation ran.
pub fn precision_label(r: &Record) -> String {
    match &r.implementation {
        Some(i) => format!("{} ({i})", r.precision),
        None => r.precision.to_string(),
    }
}

/// Relative error against the fp32 reference, or "unchecked" (--no-check).
pub fn fmt_rel_err(r: &Record) -> String {
    match &r.check {
        None => "unchecked".into(),
        Some(c) if c.rel_err == 0.0 => "0".into(),
        Some(c) => format!("{:.1e}", c.rel_err),
    }
}

/// "skipped: why" or "FAILED: why", on one line.
fn not_measured(failed: bool, reason: &str) -> String {
    format!("{}: {}", if failed { "FAILED" } else { "skipped" }, reason.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// GFLOP/s on a CPU (a few hundred at most), TFLOP/s on a GPU.
fn throughput(report: &LadderReport) -> (&'static str, f64) {
    if report.device.is_cuda() {
        ("TFLOP/s", 1.0)
    } else {
        ("GFLOP/s", 1e3)
    }
}

fn md_row(cells: &[String]) -> String {
    let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|").replace('\n', " ")).collect();
    format!("| {} |\n", cells.join(" | "))
}

fn md_table(header: &[String], rows: &[Vec<String>]) -> String {
    let mut out = md_row(header);
    out.push_str(&format!("|{}\n", "---|".repeat(header.len())));
    for row in rows {
        out.push_str(&md_row(row));
    }
    out
}

/// The ladder's table as GitHub markdown: one row per stage in ladder order, skipped and failed
/// stages included, with the reason in the precision column.
pub fn markdown_table(report: &LadderReport) -> String {
    let (unit, scale) = throughput(report);
    let header: Vec<String> =
        ["stage", "precision", "median ms (p10–p90)", "vs stage 0", "vs previous", unit, "% of peak", "rel. error", "peak mem"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let rows: Vec<Vec<String>> = report
        .rows()
        .iter()
        .map(|row| match row {
            Row::Ran(r) => vec![
                r.stage.clone(),
                precision_label(r),
                format!("{} ({}–{})", fmt_ms(r.timing.median_ms), fmt_ms(r.timing.p10_ms), fmt_ms(r.timing.p90_ms)),
                fmt_speedup_noise(r.speedup_vs_stage0, r.noise_vs_stage0),
                fmt_speedup_noise(r.speedup_vs_prev, r.noise_vs_prev),
                format!("{:.1}", r.tflops * scale),
                r.pct_of_peak.map_or("–".into(), |p| format!("{p:.1}%")),
                fmt_rel_err(r),
                fmt_bytes(r.peak_mem_bytes),
            ],
            Row::Skipped(s) => {
                let mut cells = vec![s.stage.clone(), not_measured(s.failed, &s.reason)];
                cells.resize(header.len(), "–".into());
                cells
            }
        })
        .collect();
    md_table(&header, &rows)
}

/// "CPU: AMD EPYC, 2 threads" or "GPU: NVIDIA H100 80GB HBM3 (SM 9.0), driver 580.65.06, CUDA 13.0".
pub fn describe_device(report: &LadderReport) -> String {
    let d = &report.device;
    match d.sm {
        Some((ma, mi)) => {
            let mut s = format!("GPU: {} (SM {ma}.{mi})", d.name);
            if let Some(v) = &report.nvidia_driver {
                s.push_str(&format!(", driver {v}"));
            }
            if let Some(v) = &report.cuda_driver_version {
                s.push_str(&format!(", CUDA {v}"));
            }
            s
        }
        None => format!("CPU: {}, {} threads", d.name, d.threads),
    }
}

/// The preset's name when the shape is one, and the dimensions.
pub fn describe_shape(shape: &Shape) -> String {
    let preset = [Preset::Tiny, Preset::Small, Preset::Gpt2, Preset::Te].into_iter().find(|p| p.shape() == *shape);
    match preset {
        Some(p) => format!("preset `{}` ({shape})", p.name()),
        None => format!("{shape}"),
    }
}

/// "2 warm-up + 10 timed iterations", from the records (several when they differ).
fn iterations(report: &LadderReport) -> Option<String> {
    let mut seen: Vec<(usize, usize)> = Vec::new();
    for r in &report.records {
        if !seen.contains(&(r.warmup, r.iters)) {
            seen.push((r.warmup, r.iters));
        }
    }
    (!seen.is_empty()).then(|| seen.iter().map(|(w, i)| format!("{w} warm-up + {i} timed iterations")).collect::<Vec<_>>().join(" / "))
}

/// What goes between the README's markers: where and when the run was made, the table, and the
/// chart. A pure function of the report and the two links, so re-rendering the same JSON gives
/// the same bytes.
pub fn readme_region(report: &LadderReport, json_link: &str, svg_link: &str) -> String {
    let mut facts = vec![
        format!("**{}**", describe_device(report)),
        describe_shape(&report.shape),
        format!("commit `{}`", report.commit),
        date_utc(report.unix_time),
    ];
    if let Some(v) = report.versions.get("candle-core") {
        facts.push(format!("candle-core {v}"));
    }
    if let Some(it) = iterations(report) {
        facts.push(it);
    }
    if !report.args.is_empty() {
        facts.push(format!("`ladder {}`", report.args.join(" ")));
    }
    facts.push(format!("data: [{json_link}]({json_link})"));
    let mut out = format!("<!-- Written by `ladder --update-readme` from {json_link}: rerun it rather than editing by hand. -->\n");
    out.push_str(&facts.join(" · "));
    out.push_str("\n\n");
    out.push_str(&markdown_table(report));
    if !report.records.iter().any(|r| r.speedup_vs_stage0.is_some()) {
        out.push_str("\nStage 0 did not run, so there are no speedups over it.\n");
    }
    out.push_str(&format!("\n![median ms per stage, with the speedup over stage 0 on each bar]({svg_link})\n"));
    if !report.ablation.is_empty() || !report.ablation_out.is_empty() {
        out.push_str("\n**One change at a time** (`--ablate`): each technique undone alone; \"what it buys\" is the variant's median over the stage's.\n\n");
        out.push_str(&ablation_markdown(report));
    }
    if report.records.iter().any(|r| r.breakdown.is_some()) {
        out.push_str("\n**Where the time goes** (`--breakdown`, instrumented: a sync at each part boundary, so its total differs a little from the median).\n\n");
        out.push_str(&breakdown_markdown(report));
        out.push_str(&format!("\n{}\n", REGIME_LEGEND));
        out.push_str(&format!("\n![ms per part of the block, per stage]({})\n", sibling(svg_link, "breakdown")));
    }
    out.push_str(&format!("\n![roofline: achieved GFLOP/s against FLOPs per byte]({})\n", sibling(svg_link, "roofline")));
    out
}

/// "results/ladder-cpu.svg" → "results/ladder-cpu-roofline.svg": the charts written beside the bar chart.
pub fn sibling(svg: &str, what: &str) -> String {
    match svg.strip_suffix(".svg") {
        Some(stem) => format!("{stem}-{what}.svg"),
        None => format!("{svg}-{what}.svg"),
    }
}

/// `readme` with everything between the markers of region `name` replaced by `region`; every
/// byte outside the markers is kept. Refuses (exit 2) when the markers are missing, repeated or
/// in the wrong order, rather than guessing where the table goes.
pub fn splice_readme(readme: &str, name: &str, region: &str) -> Result<String, SpeedkitError> {
    let (begin, end) = markers(name);
    let (begins, ends) = (readme.matches(&begin).count(), readme.matches(&end).count());
    if begins != 1 || ends != 1 {
        return Err(SpeedkitError::usage(format!(
            "the README must hold exactly one `{begin}` and one `{end}` line around its results, \
             but it has {begins} and {ends}; --update-readme rewrites only what lies between them \
             and will not guess. Fix: put the two markers, each on its own line, around the \
             results table (once), or point --readme / --readme-region at the right file and region."
        )));
    }
    let (b, e) = (readme.find(&begin).unwrap() + begin.len(), readme.find(&end).unwrap());
    if e < b {
        return Err(SpeedkitError::usage(format!(
            "the README's `{end}` marker comes before `{begin}`. Fix: put the begin marker above \
             the results and the end marker below them."
        )));
    }
    let mut out = String::with_capacity(readme.len() + region.len());
    out.push_str(&readme[..b]);
    out.push('\n');
    out.push_str(region);
    if !region.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&readme[e..]);
    Ok(out)
}

/// The literature's letter for a swept dimension: T, B or C.
pub fn axis_symbol(axis: &str) -> &str {
    match axis {
        "seq" => "T",
        "batch" => "B",
        "d_model" => "C",
        other => other,
    }
}

/// How a swept value is written: "T = 512", "B = 8", "C = 1024".
pub fn axis_label(axis: &str, value: usize) -> String {
    format!("{} = {value}", axis_symbol(axis))
}

/// Stage × value: median ms and the speedup over stage 0 at that value, or why it did not run.
fn sweep_grid(sweep: &SweepReport) -> (Vec<String>, Vec<Vec<String>>) {
    let mut header = vec!["stage".to_string()];
    header.extend(sweep.values.iter().map(|&v| axis_label(&sweep.axis, v)));
    let stages: Vec<String> = sweep.runs.first().map(|r| r.rows().iter().map(|row| row.stage().to_string()).collect()).unwrap_or_default();
    let rows = stages
        .iter()
        .map(|stage| {
            let mut cells = vec![stage.clone()];
            for run in &sweep.runs {
                let cell = match run.rows().into_iter().find(|r| r.stage() == stage) {
                    Some(Row::Ran(r)) => format!("{} ms · {}", fmt_ms(r.timing.median_ms), fmt_speedup(r.speedup_vs_stage0)),
                    Some(Row::Skipped(s)) if s.failed => "FAILED".into(),
                    Some(Row::Skipped(_)) => "skipped".into(),
                    None => "–".into(),
                };
                cells.push(cell);
            }
            cells
        })
        .collect();
    (header, rows)
}

/// Columns padded to their widest cell, for the terminal.
fn aligned(header: &[String], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, &w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(header);
    out.push_str(&line(&widths.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>()));
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

fn sweep_note(sweep: &SweepReport) -> String {
    let mut note = format!("cells: median ms · speedup over stage 0 at the same {}", axis_symbol(&sweep.axis));
    if sweep.axis == "d_model" {
        note.push_str(" (FF = 4·C and d_head fixed unless --ff / --heads were given)");
    }
    note
}

/// Every value's ladder as a terminal table, then the stage × value summary.
pub fn sweep_text(sweep: &SweepReport) -> String {
    let mut out = String::new();
    for (v, run) in sweep.values.iter().zip(&sweep.runs) {
        out.push_str(&format!("\n{} · {}\n", axis_label(&sweep.axis, *v), run.shape));
        out.push_str(&run.table());
    }
    let (header, rows) = sweep_grid(sweep);
    out.push_str(&format!("\nsweep over {} ({})\n", sweep.axis, sweep_note(sweep)));
    out.push_str(&aligned(&header, &rows));
    out
}

/// The same as `sweep_text`, in GitHub markdown.
pub fn sweep_markdown(sweep: &SweepReport) -> String {
    let mut out = String::new();
    for (v, run) in sweep.values.iter().zip(&sweep.runs) {
        out.push_str(&format!("\n#### {} · {}\n\n", axis_label(&sweep.axis, *v), describe_shape(&run.shape)));
        out.push_str(&markdown_table(run));
    }
    let (header, rows) = sweep_grid(sweep);
    out.push_str(&format!("\n#### Sweep over {}: {}\n\n", sweep.axis, sweep_note(sweep)));
    out.push_str(&md_table(&header, &rows));
    out
}

#[cfg(test)]
mod tests {
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
        assert_eq!(fmt_speedup(None), "–");
        assert_eq!(fmt_speedup(Some(2.126)), "2.13x");
        assert_eq!(axis_label("seq", 512), "T = 512");
    }

    #[test]
    fn recorded_cpu_run_renders() {
        // A run recorded before the report gained its provenance fields still renders.
        let json = include_str!("../../results/cpu-dev-small.json");
        let report: LadderReport = serde_json::from_str(json).unwrap();
        let md = markdown_table(&report);
        assert!(md.starts_with("| stage | precision | median ms (p10–p90) |"), "{md}");
        assert!(md.contains("| stage0_baseline | fp32 | 452 (429–465) | 1.00x | – |"), "{md}");
        let region = readme_region(&report, "results/cpu-dev-small.json", "results/x.svg");
        assert!(region.contains("**CPU: AMD EPYC, 2 threads** · preset `small` (B=4 T=512"), "{region}");
        assert!(region.contains("commit `8c37a4920778` · 2026-11-21"), "{region}");
        assert!(region.contains("2 warm-up + 20 timed iterations"), "{region}");
        assert!(region.contains("(results/x.svg)\n"), "{region}");
        assert!(region.ends_with("(results/x-roofline.svg)\n"), "{region}");
    }
}
