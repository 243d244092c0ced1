//! The roofline: each stage's achieved FLOP/s against its arithmetic intensity, under the device's compute (flat)
//! and bandwidth (slope) ceilings. FLOPs are the block's useful work; bytes the minimum its ops must move with
//! nothing cached between them (`Stage::traffic`), so fusion raises the intensity by deleting passes.

use crate::chart::{heading, is_emulated, mesh, note, stage_colour, svg, text, GRID, INK};
use crate::render::describe_device;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};
use shared::ceiling::CpuCeiling;
use shared::cli::RunArgs;
use shared::device::DeviceInfo;
use shared::perf::{operand_bytes, peak_bandwidth_gbs, peak_tflops};
use shared::report::{Ceilings, LadderReport, Mode, Record};
use shared::Precision;

#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub stage: String,
    pub precision: Precision,
    pub intensity: f64,
    /// Achieved GFLOP/s (useful FLOPs over the median time).
    pub gflops: f64,
    pub emulated: bool,
}

/// The stages' points, bytes from each stage's traffic model; an fp8 stage's activations are
/// stored like the row before it (f32 on a CPU at fp32, bf16 on a GPU), its GEMM operands in E4M3.
pub fn points(report: &LadderReport) -> Vec<Point> {
    let stages = crate::default_stages();
    let act_of = |i: usize, r: &Record| match r.precision {
        Precision::Fp8 if report.device.is_cuda() => 2.0,
        Precision::Fp8 => i.checked_sub(1).map_or(4.0, |j| operand_bytes(report.records[j].precision)),
        p => operand_bytes(p),
    };
    let point = |(i, r): (usize, &Record)| {
        let bytes = stages.iter().find(|s| s.name() == r.stage)?.traffic(&r.shape, r.precision, act_of(i, r));
        let intensity = r.flops_per_forward / bytes;
        Some(Point { stage: r.stage.clone(), precision: r.precision, intensity, gflops: r.tflops * 1e3, emulated: is_emulated(r) })
    };
    report.records.iter().enumerate().filter_map(point).collect()
}

/// The ceilings for a run, `None` when nothing is known: a flag's, else a GPU's datasheet, else a
/// CPU's measured ceiling (its GEMM rate the roof for every precision, its STREAM triad the slope).
pub fn ceilings(
    info: &DeviceInfo,
    args: &RunArgs,
    measured: Option<&CpuCeiling>,
    precisions: impl Iterator<Item = Precision>,
) -> Option<Ceilings> {
    let gpu = info.is_cuda();
    let measured = measured.filter(|_| !gpu);
    let tflops: std::collections::BTreeMap<String, f64> = precisions
        .filter_map(|p| {
            let peak = args.peak_tflops.or_else(|| if gpu { peak_tflops(&info.name, p) } else { measured.map(|c| c.peak_tflops_for(p)) });
            Some((p.name().to_string(), peak?))
        })
        .collect();
    let bandwidth_gbs = args.bandwidth_gbs.or_else(|| if gpu { peak_bandwidth_gbs(&info.name) } else { measured.map(|c| c.bandwidth_gbs) });
    if tflops.is_empty() && bandwidth_gbs.is_none() {
        return None;
    }
    let unflagged = args.peak_tflops.is_none() || args.bandwidth_gbs.is_none();
    let used = [args.peak_tflops.is_some(), args.bandwidth_gbs.is_some(), gpu && unflagged, measured.is_some() && unflagged];
    let names = ["--peak-tflops", "--bandwidth-gbs", "datasheet", "measured: GEMM at the block's shapes + STREAM triad"];
    let sources: Vec<&str> = names.into_iter().zip(used).filter_map(|(name, used)| used.then_some(name)).collect();
    Some(Ceilings { tflops, bandwidth_gbs, source: format!("{} ({})", sources.join(" + "), info.name) })
}

/// "10", "1k", "0.1": a power of ten as a tick label.
fn pow10(v: f64) -> String {
    match 10f64.powf(v.round()) {
        x if x >= 1e3 => format!("{}k", x / 1e3),
        x if x >= 1.0 => format!("{x:.0}"),
        x => format!("{x}"),
    }
}

/// How many of the points before and after `i` lie within a marker's width of point `i` (pixels).
fn overlapping(pixels: &[(i32, i32)], i: usize) -> (i32, i32) {
    let (x, y) = pixels[i];
    let near = |p: &&(i32, i32)| (p.0 - x).abs() < 12 && (p.1 - y).abs() < 12;
    (pixels[..i].iter().filter(near).count() as i32, pixels[i + 1..].iter().filter(near).count() as i32)
}

/// The roofline SVG: log-log, one point per measured stage, the ceilings as lines.
pub fn roofline_svg(report: &LadderReport) -> anyhow::Result<String> {
    let pts = points(report);
    let ceil = report.ceilings.as_ref();
    let bw = ceil.and_then(|c| c.bandwidth_gbs);
    // One roof per distinct figure (on a CPU the measured GEMM rate serves every precision), and
    // none for a precision that only emulated stages ran at: an emulation has no peak of its own.
    let emulated_only = |name: &str| {
        let mut at = report.records.iter().filter(|r| r.precision.name() == name).peekable();
        at.peek().is_some() && at.all(is_emulated)
    };
    let mut peaks: Vec<(String, f64)> = Vec::new();
    for (name, v) in ceil.into_iter().flat_map(|c| &c.tflops).filter(|(name, _)| !emulated_only(name)) {
        match peaks.iter_mut().find(|(_, p)| (*p - v * 1e3).abs() <= 1e-9 * p.abs()) {
            Some((names, _)) => *names = format!("{names}/{name}"),
            None => peaks.push((name.clone(), v * 1e3)),
        }
    }
    // Axes in log10 units, padded to whole decades around the points and the ceilings' knees.
    let xs: Vec<f64> = pts.iter().map(|p| p.intensity.log10()).chain(peaks.iter().filter_map(|(_, p)| Some((p / bw?).log10()))).collect();
    let ys: Vec<f64> = pts.iter().map(|p| p.gflops.log10()).chain(peaks.iter().map(|(_, p)| p.log10())).collect();
    let lo_hi = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        Some(((lo - 0.3).floor(), (hi + 0.3).ceil())).filter(|_| lo <= hi).unwrap_or((0.0, 1.0))
    };
    let ((x0, x1), (y0, y1)) = (lo_hi(&xs), lo_hi(&ys));
    let memory = |x: f64| (bw.unwrap_or(f64::NAN) * 10f64.powf(x)).log10();

    svg((820, 560), |root| {
        let ceiling_text = ceil
            .map_or("no ceilings known: pass --peak-tflops and --bandwidth-gbs to draw them".into(), |c| format!("ceilings: {}", c.source));
        // A training step's FLOPs are forward + backward's; the traffic model counts the forward's bytes.
        let (title, x_axis) = match report.mode() == Some(Mode::Train) {
            true => (
                "Roofline of a training step (forward + backward): achieved GFLOP/s against FLOPs per byte (log-log)",
                "x: the training step's FLOPs (forward + backward) / the bytes the forward's ops must read and write (the model counts the forward only)",
            ),
            false => (
                "Roofline: achieved GFLOP/s against FLOPs per byte moved (log-log)",
                "x: the block's FLOPs / the bytes its ops must read and write with nothing cached between ops",
            ),
        };
        let lines = [describe_device(report), crate::chart::facts(report.shape, report), ceiling_text, x_axis.into()];
        heading(root, title, text(16.0, INK, HPos::Left, VPos::Top), &lines)?;
        let mut chart = ChartBuilder::on(&root.margin(106, 14, 8, 20))
            .x_label_area_size(50)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        mesh(&mut chart, GRID, (x1 - x0) as usize + 1)
            .y_labels((y1 - y0) as usize + 1)
            .x_label_formatter(&|v| pow10(*v))
            .y_label_formatter(&|v| pow10(*v))
            .x_desc("arithmetic intensity (FLOPs per byte the block must move)")
            .y_desc("achieved GFLOP/s")
            .draw()?;
        for (name, peak) in &peaks {
            // min(peak, bandwidth · intensity), in log units, at 201 steps.
            let line: Vec<(f64, f64)> = (0..=200)
                .map(|i| x0 + (x1 - x0) * i as f64 / 200.0)
                .map(|x| (x, bw.map_or(peak.log10(), |bw| (bw * 10f64.powf(x)).min(*peak).log10())))
                .filter(|(_, y)| *y >= y0)
                .collect();
            chart.draw_series([PathElement::new(line, INK.stroke_width(2))])?;
            let label = format!("{name} peak {peak:.0} GFLOP/s");
            note(&mut chart, (x1, peak.log10()), (-6, -4), label, text(12.0, INK, HPos::Right, VPos::Bottom))?;
        }
        if let Some(bw) = bw {
            if peaks.is_empty() {
                chart.draw_series([PathElement::new(vec![(x0, memory(x0)), (x1, memory(x1))], INK.stroke_width(2))])?;
            }
            let label = format!("memory {bw:.0} GB/s");
            note(&mut chart, (x0 + 0.2, memory(x0 + 0.2)), (4, -6), label, text(12.0, INK, HPos::Left, VPos::Bottom))?;
        }
        // Points on (nearly) one pixel (stages 0 and 1 at fp32 on a CPU) fan out, labels stacked.
        let pixels: Vec<(i32, i32)> = pts.iter().map(|p| chart.backend_coord(&(p.intensity.log10(), p.gflops.log10()))).collect();
        for (i, p) in pts.iter().enumerate() {
            let c = stage_colour(&p.stage, i);
            let (before, after) = overlapping(&pixels, i);
            let (px, py) = pixels[i];
            let at = (px + 10 * before, py);
            root.draw(&Circle::new(at, 6, if p.emulated { c.stroke_width(2) } else { c.filled() }))?;
            let label = format!("{} {}{}", p.stage, p.precision, if p.emulated { " (emulated)" } else { "" });
            root.draw(&Text::new(label, (at.0 + 10 * after + 9, py + 16 * before), text(12.0, INK, HPos::Left, VPos::Center)))?;
        }
        Ok(())
    })
}

/// One `--breakdown` part on the roofline: where its regime cell put it, and the roofs it was
/// classified against (`shared::regime::annotate`: its own precision's compute roof).
#[derive(Clone, Debug, PartialEq)]
pub struct PartPoint {
    pub stage: String,
    pub part: String,
    /// The row's precision, and "(emulated)" where the row emulates it.
    pub precision: String,
    pub intensity: f64,
    pub gflops: f64,
    /// The compute roof (GFLOP/s) and memory roof (GB/s) the part was classified against.
    pub compute_roof: f64,
    pub memory_roof: f64,
    /// The cell's tag, "C 91%", "M 31%" or "U 3%" (`regime::tag`).
    pub tag: String,
}

/// Every forward part with a regime, in row order: its FLOPs per minimum byte and achieved
/// GFLOP/s, and the roofs recovered from its own cell (achieved rate over % of roof), so each
/// part sits under the roof its precision was classified against.
pub fn part_points(report: &LadderReport) -> Vec<PartPoint> {
    let mut out = Vec::new();
    for r in &report.records {
        let precision = format!("{}{}", r.precision, if is_emulated(r) { " (emulated)" } else { "" });
        for p in r.breakdown.iter().flat_map(|b| &b.parts) {
            let Some(g) = &p.regime else { continue };
            if !(g.min_bytes > 0.0 && g.pct_of_compute_roof > 0.0 && g.pct_of_memory_roof > 0.0) {
                continue;
            }
            out.push(PartPoint {
                stage: r.stage.clone(),
                part: p.name.clone(),
                precision: precision.clone(),
                intensity: g.flops / g.min_bytes,
                gflops: g.gflops,
                compute_roof: 100.0 * g.gflops / g.pct_of_compute_roof,
                memory_roof: 100.0 * g.gbs / g.pct_of_memory_roof,
                tag: shared::regime::tag(g),
            });
        }
    }
    out
}

/// The roofs of a set of part points: each distinct compute roof (to 0.1 %), named by the
/// precisions classified against it, with the memory roof beside it.
fn part_roofs(pts: &[PartPoint]) -> Vec<(String, f64, f64)> {
    let mut roofs: Vec<(String, f64, f64)> = Vec::new();
    for p in pts {
        match roofs.iter_mut().find(|(_, c, m)| (c - p.compute_roof).abs() <= 1e-3 * c && (m - p.memory_roof).abs() <= 1e-3 * m) {
            Some((names, _, _)) if !names.split('/').any(|n| n == p.precision) => *names = format!("{names}/{}", p.precision),
            Some(_) => {}
            None => roofs.push((p.precision.clone(), p.compute_roof, p.memory_roof)),
        }
    }
    roofs
}

/// Roof colours: the first (on a CPU run, f32's) dark, the next blue, then more.
const ROOF_COLOURS: [RGBColor; 4] =
    [RGBColor(0x44, 0x44, 0x44), RGBColor(0x1f, 0x77, 0xb4), RGBColor(0xd6, 0x27, 0x28), RGBColor(0x2c, 0xa0, 0x2c)];

/// The parts' roofline (`ladder render --parts-roofline`): every `--breakdown` part of every row,
/// numbered and listed with its regime cell, under the roof of its own precision (each drawn in
/// that roof's colour, with the 30 % line that separates C and M from U dashed beneath it).
pub fn parts_roofline_svg(report: &LadderReport) -> anyhow::Result<String> {
    let pts = part_points(report);
    if pts.is_empty() {
        anyhow::bail!(shared::SpeedkitError::usage(
            "this run has no --breakdown parts with a regime (recorded without --breakdown, or without a compute and a memory roof), \
             so there is nothing to place on the parts' roofline. Fix: render a run recorded with --breakdown."
                .to_string()
        ));
    }
    let roofs = part_roofs(&pts);
    let roof_of = |p: &PartPoint| {
        roofs.iter().position(|(_, c, m)| (c - p.compute_roof).abs() <= 1e-3 * c && (m - p.memory_roof).abs() <= 1e-3 * m).unwrap_or(0)
    };
    let explained = shared::regime::EXPLAINED;
    let xs: Vec<f64> = pts.iter().map(|p| p.intensity.log10()).chain(roofs.iter().map(|(_, c, m)| (c / m).log10())).collect();
    let ys: Vec<f64> = pts.iter().map(|p| p.gflops.log10()).chain(roofs.iter().map(|(_, c, _)| c.log10())).collect();
    let lo_hi = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        ((lo - 0.3).floor(), (hi + 0.3).ceil())
    };
    let ((x0, x1), (y0, y1)) = (lo_hi(&xs), lo_hi(&ys));
    let legend_rows = pts.len() as u32;
    let height = (200 + 15 * legend_rows).max(640);
    svg((1100, height), |root| {
        let lines = [
            describe_device(report),
            crate::chart::facts(report.shape, report),
            "Each part of each row's --breakdown, at its FLOPs per byte (the minimum its ops must move) and achieved GFLOP/s, \
             under the roof of its own precision"
                .to_string(),
            format!(
                "(the roofs its regime cell was classified against). C: at least {:.0} % of the compute roof, M: of the memory roof, \
                 U: below the dashed line, neither roof explains the time.",
                100.0 * explained
            ),
        ];
        let title = "The roofline, part by part: what bounds each part of the block (regimes C, M and U)";
        heading(root, title, text(16.0, INK, HPos::Left, VPos::Top), &lines)?;
        let (plot, legend) = root.margin(110, 14, 8, 20).split_horizontally(760);
        let mut chart = ChartBuilder::on(&plot).x_label_area_size(50).y_label_area_size(64).build_cartesian_2d(x0..x1, y0..y1)?;
        mesh(&mut chart, GRID, (x1 - x0) as usize + 1)
            .y_labels((y1 - y0) as usize + 1)
            .x_label_formatter(&|v| pow10(*v))
            .y_label_formatter(&|v| pow10(*v))
            .x_desc("arithmetic intensity (FLOPs per byte the part must move)")
            .y_desc("achieved GFLOP/s")
            .draw()?;
        // The highest roof first, so the lowest one's line (the memory slope they share) is on top.
        let lowest = (0..roofs.len()).min_by(|&a, &b| roofs[a].1.total_cmp(&roofs[b].1)).unwrap_or(0);
        let mut order: Vec<usize> = (0..roofs.len()).collect();
        order.sort_by(|&a, &b| roofs[b].1.total_cmp(&roofs[a].1));
        for i in order {
            let (names, compute, memory) = &roofs[i];
            let colour = ROOF_COLOURS[i % ROOF_COLOURS.len()];
            // min(compute, memory · intensity), and EXPLAINED of it, in log units at 201 steps.
            let roof = |scale: f64| -> Vec<(f64, f64)> {
                (0..=200)
                    .map(|k| x0 + (x1 - x0) * k as f64 / 200.0)
                    .map(|x| (x, (scale * (memory * 10f64.powf(x)).min(*compute)).log10()))
                    .filter(|(_, y)| *y >= y0)
                    .collect()
            };
            chart.draw_series([PathElement::new(roof(1.0), colour.stroke_width(2))])?;
            chart.draw_series(DashedLineSeries::new(roof(explained), 6, 4, colour.stroke_width(1)))?;
            // Each label at its ridge point: the lowest roof's under its line, the others above.
            let label = format!("{names} roof {compute:.0} GFLOP/s");
            let (ridge, below) = ((compute / memory).log10(), i == lowest);
            let (offset, v) = if below { ((6, 4), VPos::Top) } else { ((6, -4), VPos::Bottom) };
            note(&mut chart, (ridge, compute.log10()), offset, label, text(12.0, colour, HPos::Left, v))?;
            if below {
                let label = format!("memory {memory:.0} GB/s");
                let at = x0 + 0.6;
                note(&mut chart, (at, (memory * 10f64.powf(at)).log10()), (4, -6), label, text(12.0, colour, HPos::Left, VPos::Bottom))?;
            }
        }
        for (i, p) in pts.iter().enumerate() {
            let colour = ROOF_COLOURS[roof_of(p) % ROOF_COLOURS.len()];
            let at = (p.intensity.log10(), p.gflops.log10());
            chart.draw_series([Circle::new(at, 4, colour.filled())])?;
            note(&mut chart, at, (5, -3), format!("{}", i + 1), text(10.0, colour, HPos::Left, VPos::Bottom))?;
        }
        for (i, p) in pts.iter().enumerate() {
            let colour = ROOF_COLOURS[roof_of(p) % ROOF_COLOURS.len()];
            let line = format!("{:>2}  {} {}  {} · {}", i + 1, p.stage, p.part, p.tag, p.precision);
            legend.draw(&Text::new(line, (10, 10 + 15 * i as i32), text(11.0, colour, HPos::Left, VPos::Top)))?;
        }
        Ok(())
    })
}

#[cfg(test)]
#[path = "../tests/unit/roofline.rs"]
mod tests;
