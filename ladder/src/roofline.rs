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

#[cfg(test)]
#[path = "../tests/unit/roofline.rs"]
mod tests;
