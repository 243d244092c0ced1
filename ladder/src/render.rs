//! The ladder as text: markdown and terminal tables, and the README's results region and splice.

use crate::provenance::date_utc;
use itertools::Itertools;
use shared::report::{fmt_ms, fmt_timing, not_measured, speedup_text, table, Grid, LadderReport, Mode, Record, Row, SweepReport};
use shared::{Preset, Shape, SpeedkitError};

/// The lines around README region `name`.
pub fn markers(name: &str) -> (String, String) {
    (format!("<!-- {name}:begin -->"), format!("<!-- {name}:end -->"))
}

/// `--readme-region`: letters, digits, '-' and '_', so the name cannot break the comment.
pub fn region_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    ok.then(|| s.to_string()).ok_or_else(|| format!("'{s}' is not a region name; use letters, digits, '-' and '_', e.g. results-gpu"))
}

/// `--ablate`'s table: each variant (or why it did not run), and what the undone change buys.
pub fn ablation_table(report: &LadderReport, markdown: bool) -> String {
    let header = ["stage", "undone", "median ms (p10–p90)", "stage as written", "what it buys"].map(String::from).to_vec();
    let ran = report.ablation.iter().map(|a| {
        let full = report.records.iter().find(|r| r.stage == a.against);
        let full = full.map_or("–".into(), |r| format!("{} ms", fmt_ms(r.timing.median_ms)));
        vec![a.against.clone(), a.change.clone(), fmt_timing(&a.record.timing), full, speedup_text(a.buys, a.buys_within_noise)]
    });
    let out = report.ablation_out.iter().map(|o| vec![o.against.clone(), o.change.clone(), not_measured(o.failed, &o.reason)]);
    table((header, ran.chain(out).collect()), markdown)
}

/// What the tags in the breakdown's cells mean (`shared::regime`).
pub const REGIME_LEGEND: &str = "Each cell: ms · regime. **C** compute-bound (% of the compute roof), **M** memory-bound \
(% of the memory roof, counting the bytes the part must move at least), **U** unexplained: under 30 % of the roof its \
FLOPs per byte put it under, so neither roof explains the time (extra passes, launches, syncs, scalar code). On a CPU the \
compute roof is one rate for the whole block (its FLOPs over their time at each GEMM shape's probed rate), so a part whose \
own shape runs faster than the block's mix, or that ran in a quicker moment than the probe's few timings, can show above \
100 %; the JSON's `ceiling.gemms` holds each shape's own rate. The JSON holds each part's FLOPs, minimum bytes, GFLOP/s and GB/s.";

/// The names of the parts in `records`' breakdowns, in first-seen order.
pub(crate) fn part_names(records: &[&Record]) -> Vec<String> {
    records.iter().flat_map(|r| r.breakdown.iter().flat_map(|b| &b.parts)).map(|p| p.name.clone()).unique().collect()
}

/// A part's cell: "ms · regime tag", its regime as `ladder::run` or `ladder::load` computed it
/// (never a file's own).
fn part_cell(p: &shared::breakdown::PartTime) -> String {
    match &p.regime {
        Some(g) => format!("{} · {}", fmt_ms(p.median_ms), shared::regime::tag(g)),
        None => fmt_ms(p.median_ms),
    }
}

/// `--breakdown`'s table: a row per stage, a column per part (forward order), total and median.
pub fn breakdown_table(report: &LadderReport, markdown: bool) -> String {
    let with: Vec<&Record> = report.records.iter().filter(|r| r.breakdown.is_some()).collect();
    let mut parts = part_names(&with);
    let order = |name: &str| shared::breakdown::PARTS.iter().position(|p| name.starts_with(p)).unwrap_or(usize::MAX);
    parts.sort_by_key(|p| order(p)); // stable: a fused part sits after its first part's own column
    let mut header = vec!["stage".to_string()];
    header.extend(parts.iter().map(|p| format!("{p} ms")));
    header.extend(["total (instrumented)", "median (uninstrumented)"].map(String::from));
    let rows = with
        .iter()
        .map(|&r| {
            let b = r.breakdown.as_ref().expect("filtered");
            let mut row = vec![r.stage.clone()];
            row.extend(parts.iter().map(|name| b.parts.iter().find(|p| &p.name == name).map_or("–".into(), part_cell)));
            row.extend([b.total_ms, r.timing.median_ms].map(|ms| format!("{} ms", fmt_ms(ms))));
            row
        })
        .collect();
    table((header, rows), markdown)
}

/// `--train --breakdown`'s second table: a row per stage, a column per part's backward (in the
/// order the backward runs them: the forward's reversed), then the optimizer's update.
pub fn backward_table(report: &LadderReport, markdown: bool) -> String {
    let with: Vec<&Record> = report.records.iter().filter(|r| r.breakdown.as_ref().is_some_and(|b| !b.backward.is_empty())).collect();
    let mut parts: Vec<String> =
        with.iter().flat_map(|r| r.breakdown.iter().flat_map(|b| &b.backward)).map(|p| p.name.clone()).unique().collect();
    let order = |name: &str| match name {
        "optimizer" => usize::MAX,
        _ => usize::MAX - 1 - shared::breakdown::PARTS.iter().position(|p| name.starts_with(p)).unwrap_or(0),
    };
    parts.sort_by_key(|p| order(p));
    let mut header = vec!["stage".to_string()];
    header.extend(parts.iter().map(|p| format!("{p} ms")));
    header.push("backward (sum)".into());
    let rows = with
        .iter()
        .map(|&r| {
            let b = r.breakdown.as_ref().expect("filtered");
            let mut row = vec![r.stage.clone()];
            row.extend(parts.iter().map(|name| b.backward.iter().find(|p| &p.name == name).map_or("–".into(), part_cell)));
            let sum: f64 = b.backward.iter().filter(|p| p.name != "optimizer").map(|p| p.median_ms).sum();
            row.push(format!("{} ms", fmt_ms(sum)));
            row
        })
        .collect();
    table((header, rows), markdown)
}

/// "CPU: AMD EPYC, 2 threads" or "GPU: NVIDIA H100 80GB HBM3 (SM 9.0), driver 580.65.06, CUDA 13.0".
pub fn describe_device(report: &LadderReport) -> String {
    let d = &report.device;
    match d.sm {
        Some((ma, mi)) => {
            let driver = report.nvidia_driver.as_ref().map(|v| format!(", driver {v}")).unwrap_or_default();
            let cuda = report.cuda_driver_version.as_ref().map(|v| format!(", CUDA {v}")).unwrap_or_default();
            format!("GPU: {} (SM {ma}.{mi}){driver}{cuda}", d.name)
        }
        None if d.cpu_flags.is_empty() => format!("CPU: {}, {} threads", d.name, d.threads),
        None => format!("CPU: {}, {} threads, {}", d.name, d.threads, d.cpu_flags.join(" ")),
    }
}

/// The preset's name when the shape is one, and the dimensions.
pub fn describe_shape(shape: &Shape) -> String {
    let preset = [Preset::Tiny, Preset::Small, Preset::Gpt2, Preset::Te].into_iter().find(|p| p.shape() == *shape);
    preset.map_or(format!("{shape}"), |p| format!("preset `{}` ({shape})", p.name()))
}

/// The regions that live on a docs page beside the README, and the page: the CPU run in full
/// (`results-cpu`), the H100 runs' (`results-gpu-*`) and the training runs' (`results-train`, `results-gpu-train`).
pub const DOCS_REGIONS: [(&str, &str); 8] = [
    ("results-cpu", "docs/measuring.md"),
    ("results-gpu-te", "docs/gpu.md"),
    ("results-gpu-ablate-te", "docs/gpu.md"),
    ("results-gpu-graph", "docs/gpu.md"),
    ("results-gpu-gpt2", "docs/gpu.md"),
    ("results-gpu-ablate-gpt2", "docs/gpu.md"),
    ("results-train", "docs/training.md"),
    ("results-gpu-train", "docs/training.md"),
];

/// The README's regions that show a run's table and bar chart only, each with the docs region
/// that shows the same run in full (ablations, breakdown, roofline): `--update-readme` writes both.
pub const SUMMARY_REGIONS: [(&str, &str); 2] = [("results", "results-cpu"), ("results-gpu", "results-gpu-te")];

/// The docs region that shows summary region `name`'s run in full, if `name` is a summary region.
pub fn full_region(name: &str) -> Option<&'static str> {
    SUMMARY_REGIONS.iter().find(|(s, _)| *s == name).map(|(_, full)| *full)
}

/// What README region `name` shows: training steps when a word of its name (split at '-' and '_')
/// is `train` (`results-train`), forwards otherwise (`results`, `results-gpu`, docs/gpu.md's).
pub fn region_mode(name: &str) -> Mode {
    if name.split(['-', '_']).any(|w| w == "train") {
        Mode::Train
    } else {
        Mode::Forward
    }
}

/// Refuse results of `mode` (described by `what`, e.g. "this run" or "x.json") for a region that
/// shows the other mode: a training table would replace the forward one, or the other way round.
pub fn check_region_mode(region: &str, mode: Mode, what: &str) -> Result<(), SpeedkitError> {
    let shows = region_mode(region);
    if shows == mode {
        return Ok(());
    }
    let (times, fix) = match mode {
        Mode::Train => ("training steps (--train)", "pass --readme-region results-train (the training region)"),
        Mode::Forward => ("forwards", "pass a forward region, e.g. --readme-region results (results-gpu for a GPU run)"),
    };
    Err(SpeedkitError::usage(format!(
        "{what} times {times}, but the README region {region} shows {}s, so its table would be replaced by results of \
         the other kind. Fix: {fix}, or {}.",
        shows.per(),
        match mode {
            Mode::Train => "render or run a forward (no --train) into this region",
            Mode::Forward => "render or run a --train run into this region",
        }
    )))
}

/// The page `--update-readme` rewrites for `region` (`readme`, or the docs page of `DOCS_REGIONS`
/// beside it), and the prefix that turns a link from the README's folder into one from that page.
pub fn region_page(readme: &std::path::Path, region: &str) -> (std::path::PathBuf, String) {
    match DOCS_REGIONS.iter().find(|(r, _)| *r == region) {
        Some((_, page)) => (crate::readme_dir(readme).join(page), "../".into()),
        None => (readme.to_path_buf(), String::new()),
    }
}

/// What goes between region `name`'s markers: the run in full (`readme_region`), or for a summary
/// region (`SUMMARY_REGIONS`) its table and bar chart, and a link to the page that has the rest.
pub fn region_text(name: &str, report: &LadderReport, json_link: &str, svg_link: &str) -> String {
    let Some(full) = full_region(name) else { return readme_region(report, json_link, svg_link) };
    let page = DOCS_REGIONS.iter().find(|(r, _)| *r == full).map_or("", |(_, p)| *p);
    let of = if report.mode() == Some(Mode::Train) { "a training step" } else { "the block" };
    let rest = match (report.records.iter().any(|r| r.breakdown.is_some()), report.ablation.is_empty()) {
        (true, true) => format!("Where the time goes in {of}, part by part, and the roofline"),
        (true, false) => format!("One change at a time, where the time goes in {of}, and the roofline"),
        (false, false) => format!("One change at a time, and the roofline of {of}"),
        (false, true) => format!("The roofline of {of}"),
    };
    summary_region(report, json_link, svg_link) + &format!("\n{rest}: [{page}]({page}).\n")
}

/// The head of a region: the run's facts, its table and its bar chart.
fn summary_region(report: &LadderReport, json_link: &str, svg_link: &str) -> String {
    let mut facts = vec![
        format!("**{}**", describe_device(report)),
        describe_shape(&report.shape),
        format!("commit `{}`", report.commit),
        date_utc(report.unix_time),
    ];
    facts.extend(report.versions.get("candle-core").map(|v| format!("candle-core {v}")));
    let iterations = report.records.iter().map(|r| format!("{} warm-up + {} timed iterations", r.warmup, r.iters)).unique().join(" / ");
    facts.extend((!iterations.is_empty()).then_some(iterations));
    facts.extend((!report.args.is_empty()).then(|| format!("`ladder {}`", report.args.join(" "))));
    facts.push(format!("data: [{json_link}]({json_link})"));
    let mut out = format!("<!-- Written by `ladder --update-readme` from {json_link}: rerun it rather than editing by hand. -->\n");
    out += &format!("{}\n\n{}", facts.join(" · "), report.table(true));
    if !report.records.iter().any(|r| r.speedup_vs_stage0.is_some()) {
        out += "\nStage 0 did not run, so there are no speedups over it.\n";
    }
    let per = if report.mode() == Some(Mode::Train) { " per training step" } else { "" };
    out + &format!("\n![median ms{per} per stage, with the speedup over stage 0 on each bar]({svg_link})\n")
}

/// What goes between the README's markers; a pure function, so the same JSON gives the same bytes.
pub fn readme_region(report: &LadderReport, json_link: &str, svg_link: &str) -> String {
    let mut out = summary_region(report, json_link, svg_link);
    let train = report.mode() == Some(Mode::Train);
    if !report.ablation.is_empty() || !report.ablation_out.is_empty() {
        out += "\n**One change at a time** (`--ablate`): each technique undone alone; \"what it buys\" is the variant's median over the stage's.\n\n";
        out += &ablation_table(report, true);
    }
    if report.records.iter().any(|r| r.breakdown.is_some()) {
        out += "\n**Where the time goes** (`--breakdown`, instrumented: a sync at each part boundary, so its total differs a little from the median).\n\n";
        out += &format!("{}\n{REGIME_LEGEND}\n", breakdown_table(report, true));
        if report.records.iter().any(|r| r.breakdown.as_ref().is_some_and(|b| !b.backward.is_empty())) {
            out += "\n**The backward by part** (`--train --breakdown`: each part's backward, timed from the one before it to its inputs' gradients being complete, in the order it runs; then the optimizer's update).\n\n";
            out += &format!("{}\n", backward_table(report, true));
        }
        let of = if train { "a training step" } else { "the block" };
        out += &format!("\n![ms per part of {of}, per stage]({})\n", sibling(svg_link, "breakdown"));
    }
    let roofline = if train { "roofline of a training step" } else { "roofline" };
    out + &format!("\n![{roofline}: achieved GFLOP/s against FLOPs per byte]({})\n", sibling(svg_link, "roofline"))
}

/// "results/ladder-cpu.svg" → "results/ladder-cpu-roofline.svg": the charts written beside the bar chart.
pub fn sibling(svg: &str, what: &str) -> String {
    format!("{}-{what}.svg", svg.strip_suffix(".svg").unwrap_or(svg))
}

/// `readme` with region `name` replaced, every other byte kept; refuses (exit 2) rather than guess.
pub fn splice_readme(readme: &str, name: &str, region: &str) -> Result<String, SpeedkitError> {
    let (begin, end) = markers(name);
    let (begins, ends) = (readme.matches(&begin).count(), readme.matches(&end).count());
    if begins != 1 || ends != 1 {
        return Err(SpeedkitError::usage(format!(
            "the README must hold exactly one `{begin}` and one `{end}` line around its results, but it has {begins} and {ends}; \
             --update-readme rewrites only what lies between them and will not guess. Fix: put the two markers, each on its own \
             line, around the results table (once), or point --readme / --readme-region at the right file and region."
        )));
    }
    let (b, e) = (readme.find(&begin).unwrap() + begin.len(), readme.find(&end).unwrap());
    if e < b {
        return Err(SpeedkitError::usage(format!(
            "the README's `{end}` marker comes before `{begin}`. Fix: put the begin marker above the results and the end marker below them."
        )));
    }
    let newline = if region.ends_with('\n') { "" } else { "\n" };
    Ok(format!("{}\n{region}{newline}{}", &readme[..b], &readme[e..]))
}

/// Each swept dimension as the JSON names it, the literature's letter, and what it counts.
pub const AXES: [(&str, &str, &str); 3] =
    [("seq", "T", "tokens per sequence"), ("batch", "B", "sequences per forward"), ("d_model", "C", "model width")];

/// The literature's letter for a swept dimension: T, B or C.
pub fn axis_symbol(axis: &str) -> &str {
    AXES.iter().find(|a| a.0 == axis).map_or(axis, |a| a.1)
}

/// How a swept value is written: "T = 512", "B = 8", "C = 1024".
pub fn axis_label(axis: &str, value: usize) -> String {
    format!("{} = {value}", axis_symbol(axis))
}

/// A sweep's stages, in ladder order.
pub(crate) fn sweep_stages(sweep: &SweepReport) -> Vec<String> {
    sweep.runs.first().map(|r| r.rows().iter().map(|row| row.stage().to_string()).collect()).unwrap_or_default()
}

/// Stage × value: median ms and the speedup over stage 0 at that value, or why it did not run.
fn sweep_grid(sweep: &SweepReport) -> Grid {
    let header = std::iter::once("stage".to_string()).chain(sweep.values.iter().map(|&v| axis_label(&sweep.axis, v))).collect();
    let cell = |run: &LadderReport, stage: &str| match run.rows().into_iter().find(|r| r.stage() == stage) {
        Some(Row::Ran(r)) => format!("{} ms · {}", fmt_ms(r.timing.median_ms), speedup_text(r.speedup_vs_stage0, false)),
        Some(Row::Skipped(s)) if s.failed => "FAILED".into(),
        Some(Row::Skipped(_)) => "skipped".into(),
        None => "–".into(),
    };
    let rows = sweep_stages(sweep)
        .into_iter()
        .map(|stage| std::iter::once(stage.clone()).chain(sweep.runs.iter().map(|run| cell(run, &stage))).collect())
        .collect();
    (header, rows)
}

/// Every value's ladder, then the stage × value summary: GitHub markdown or the terminal's tables.
pub fn sweep_tables(sweep: &SweepReport, markdown: bool) -> String {
    let runs = sweep.values.iter().zip(&sweep.runs).map(|(v, run)| match markdown {
        true => format!("\n#### {} · {}\n\n{}", axis_label(&sweep.axis, *v), describe_shape(&run.shape), run.table(true)),
        false => format!("\n{} · {}\n{}", axis_label(&sweep.axis, *v), run.shape, run.table(false)),
    });
    let d_model = if sweep.axis == "d_model" { " (FF = 4·C and d_head fixed unless --ff / --heads were given)" } else { "" };
    let train = sweep.runs.first().and_then(|r| r.mode()) == Some(Mode::Train);
    let per = if train { " per training step" } else { "" };
    let note = format!("cells: median ms{per} · speedup over stage 0 at the same {}{d_model}", axis_symbol(&sweep.axis));
    let summary = match markdown {
        true => format!("\n#### Sweep over {}: {note}\n\n", sweep.axis),
        false => format!("\nsweep over {} ({note})\n", sweep.axis),
    };
    runs.collect::<String>() + &summary + &table(sweep_grid(sweep), markdown)
}

#[cfg(test)]
#[path = "../tests/unit/render.rs"]
mod tests;
