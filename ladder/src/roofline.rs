//! The roofline: each stage's achieved FLOP/s against its arithmetic intensity (FLOPs per byte
//! the block must move), under the device's ceilings: compute (flat) and memory bandwidth
//! (slope). A stage under the slope is memory-bound, one under the flat line compute-bound.
//!
//! **FLOPs** are `shared::perf::block_flops` (useful work, the same for every stage).
//! **Bytes** are counted from the shapes and dtypes, op by op, as the minimum each op must
//! read and write if nothing stays in cache between ops (each stage's `Stage::traffic`, over `shared::perf::Traffic`); fusion raises the
//! intensity by deleting whole passes, which is what the chart shows. Per op:
//! - a GEMM reads its input (N·K) and weight (K·M) and writes its output (N·M), in the GEMM
//!   dtype (E4M3 operands in stage 4, plus the quantising pass that reads and writes each input);
//! - an element-wise pass reads and writes a whole activation (N·C or N·FF); the pass counts
//!   per part are stage 3's header table (stage 2: LayerNorm 8 passes with the cast, bias 1,
//!   GELU 9, residual add with its cast 2; stage 3: LayerNorm 2, add+LayerNorm 1, fc2's
//!   residual 2 at 16-bit, 0 at f32 where it rides in the GEMM);
//! - naive attention (stages 0–1) writes the (B, n_head, T, T) scores in f32 and passes over
//!   them 6 more times (scale, mask, max, exp, sum, divide: ~6 reads, 4 writes) before P·V reads
//!   them, plus the head split (3 copies) and merge (1 copy); fused attention reads q, k, v
//!   once and writes its output once.
//!
//! Ceilings: a GPU's datasheet peak per precision and memory bandwidth (`shared::perf`); on a
//! CPU, `--peak-tflops` and `--bandwidth-gbs` (a measured ceiling probe can fill `Ceilings`
//! in the same way, with its own `source`). Without a ceiling the points are drawn alone.

use crate::provenance::date_utc;
use crate::render::describe_device;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use shared::ceiling::CpuCeiling;
use shared::cli::RunArgs;
use shared::device::DeviceInfo;
use shared::perf::{operand_bytes, peak_bandwidth_gbs, peak_tflops};
use shared::report::{Ceilings, LadderReport, Record};
use shared::Precision;
use std::collections::BTreeMap;

/// One point of the roofline.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub stage: String,
    pub precision: Precision,
    /// FLOPs per byte.
    pub intensity: f64,
    /// Achieved GFLOP/s (useful FLOPs over the median time).
    pub gflops: f64,
    pub emulated: bool,
}

/// The stages' points, each stage's bytes from its own traffic model (`Stage::traffic`). An
/// fp8 stage stores its activations like the row before it (f32 on a CPU at fp32, bf16 on a
/// GPU), its GEMM operands in E4M3.
pub fn points(report: &LadderReport) -> Vec<Point> {
    let stages = crate::default_stages();
    let act_of = |i: usize, r: &Record| match r.precision {
        Precision::Fp8 if report.device.is_cuda() => 2.0,
        Precision::Fp8 => i.checked_sub(1).map_or(4.0, |j| operand_bytes(report.records[j].precision)),
        p => operand_bytes(p),
    };
    report
        .records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let stage = stages.iter().find(|s| s.name() == r.stage)?;
            let bytes = stage.traffic(&r.shape, r.precision, act_of(i, r));
            Some(Point {
                stage: r.stage.clone(),
                precision: r.precision,
                intensity: r.flops_per_forward / bytes,
                gflops: r.tflops * 1e3,
                emulated: r.implementation.as_deref().is_some_and(|i| i.starts_with(shared::stage::EMULATED)),
            })
        })
        .collect()
}

/// The ceilings for a run: the datasheet's on a known GPU, the flags' otherwise (a flag
/// overrides the datasheet). `None` when nothing is known.
/// On a CPU with a measured ceiling (`shared::ceiling`, probed when the session opened), that
/// ceiling's GEMM rate is the compute roof for every precision and its STREAM triad the memory
/// slope, unless a flag gives another figure.
pub fn ceilings(
    info: &DeviceInfo,
    args: &RunArgs,
    measured: Option<&CpuCeiling>,
    precisions: impl Iterator<Item = Precision>,
) -> Option<Ceilings> {
    let mut tflops = BTreeMap::new();
    for p in precisions {
        let peak = args.peak_tflops.or_else(|| match measured {
            Some(c) if !info.is_cuda() => Some(c.peak_tflops()),
            _ if info.is_cuda() => peak_tflops(&info.name, p),
            _ => None,
        });
        if let Some(v) = peak {
            tflops.insert(p.name().to_string(), v);
        }
    }
    let datasheet_bw = if info.is_cuda() { peak_bandwidth_gbs(&info.name) } else { None };
    let bandwidth_gbs = args.bandwidth_gbs.or(datasheet_bw).or(measured.filter(|_| !info.is_cuda()).map(|c| c.bandwidth_gbs));
    if tflops.is_empty() && bandwidth_gbs.is_none() {
        return None;
    }
    let mut sources = Vec::new();
    if args.peak_tflops.is_some() {
        sources.push("--peak-tflops");
    }
    if args.bandwidth_gbs.is_some() {
        sources.push("--bandwidth-gbs");
    }
    if info.is_cuda() && (args.peak_tflops.is_none() || args.bandwidth_gbs.is_none()) {
        sources.push("datasheet");
    }
    if !info.is_cuda() && measured.is_some() && (args.peak_tflops.is_none() || args.bandwidth_gbs.is_none()) {
        sources.push("measured: GEMM at the block's shapes + STREAM triad");
    }
    Some(Ceilings { tflops, bandwidth_gbs, source: format!("{} ({})", sources.join(" + "), info.name) })
}

const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
const MUTED: RGBColor = RGBColor(0x66, 0x66, 0x66);

fn text(size: f64, colour: RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    TextStyle { font: ("sans-serif", size * 1.24).into_font(), color: colour.to_backend_color(), pos: Pos::new(h, v) }
}

/// "10", "1k", "0.1": a power of ten as a tick label.
fn pow10(v: f64) -> String {
    let x = 10f64.powf(v.round());
    match x {
        x if x >= 1e3 => format!("{}k", x / 1e3),
        x if x >= 1.0 => format!("{x:.0}"),
        x => format!("{x}"),
    }
}

/// How many of the points before `i` lie within a marker's width of point `i` (pixels).
fn overlapping_before(pixels: &[(i32, i32)], i: usize) -> usize {
    let (x, y) = pixels[i];
    pixels[..i].iter().filter(|(a, b)| (a - x).abs() < 12 && (b - y).abs() < 12).count()
}

/// How many of the points after `i` lie within a marker's width of point `i` (pixels).
fn overlapping_after(pixels: &[(i32, i32)], i: usize) -> usize {
    let (x, y) = pixels[i];
    pixels[i + 1..].iter().filter(|(a, b)| (a - x).abs() < 12 && (b - y).abs() < 12).count()
}

/// The roofline SVG: log-log, one point per measured stage, the ceilings as lines.
pub fn roofline_svg(report: &LadderReport) -> anyhow::Result<String> {
    let pts = points(report);
    let ceil = report.ceilings.as_ref();
    let bw = ceil.and_then(|c| c.bandwidth_gbs);
    // One roof per distinct figure (on a CPU the measured GEMM rate serves every precision), and
    // none for a precision that only emulated stages ran at: an emulation has no peak of its own.
    let emulated_only = |name: &str| {
        let at: Vec<&Record> = report.records.iter().filter(|r| r.precision.name() == name).collect();
        !at.is_empty() && at.iter().all(|r| r.implementation.as_deref().is_some_and(|i| i.starts_with(shared::stage::EMULATED)))
    };
    let mut peaks: Vec<(String, f64)> = Vec::new();
    for (name, v) in ceil.map(|c| c.tflops.iter().collect::<Vec<_>>()).unwrap_or_default() {
        if emulated_only(name) {
            continue;
        }
        match peaks.iter_mut().find(|(_, p)| (*p - v * 1e3).abs() <= 1e-9 * p.abs()) {
            Some((names, _)) => *names = format!("{names}/{name}"),
            None => peaks.push((name.clone(), v * 1e3)),
        }
    }
    // Axes in log10 units, padded to whole decades around the points and the ceilings' knees.
    let mut xs: Vec<f64> = pts.iter().map(|p| p.intensity.log10()).collect();
    let mut ys: Vec<f64> = pts.iter().map(|p| p.gflops.log10()).collect();
    for (_, peak) in &peaks {
        ys.push(peak.log10());
        if let Some(bw) = bw {
            xs.push((peak / bw).log10()); // the knee: intensity where bandwidth meets compute
        }
    }
    let lo_hi = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        if lo > hi {
            (0.0, 1.0)
        } else {
            ((lo - 0.3).floor(), (hi + 0.3).ceil())
        }
    };
    let ((x0, x1), (y0, y1)) = (lo_hi(&xs), lo_hi(&ys));

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (820, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = "Roofline: achieved GFLOP/s against FLOPs per byte moved (log-log)";
        root.draw(&Text::new(title, (20, 12), text(16.0, INK, HPos::Left, VPos::Top)))?;
        root.draw(&Text::new(describe_device(report), (20, 36), text(12.0, MUTED, HPos::Left, VPos::Top)))?;
        let ceiling_text = match ceil {
            Some(c) => format!("ceilings: {}", c.source),
            None => "no ceilings known: pass --peak-tflops and --bandwidth-gbs to draw them".into(),
        };
        let facts = format!("{} · commit {} · {}", report.shape, report.commit, date_utc(report.unix_time));
        root.draw(&Text::new(facts, (20, 53), text(12.0, MUTED, HPos::Left, VPos::Top)))?;
        root.draw(&Text::new(ceiling_text, (20, 70), text(12.0, MUTED, HPos::Left, VPos::Top)))?;
        let x_axis = "x: the block's FLOPs / the bytes its ops must read and write with nothing cached between ops";
        root.draw(&Text::new(x_axis, (20, 87), text(12.0, MUTED, HPos::Left, VPos::Top)))?;
        let body = root.margin(106, 14, 8, 20);
        let mut chart = ChartBuilder::on(&body).x_label_area_size(50).y_label_area_size(64).build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_labels((x1 - x0) as usize + 1)
            .y_labels((y1 - y0) as usize + 1)
            .x_label_formatter(&|v| pow10(*v))
            .y_label_formatter(&|v| pow10(*v))
            .x_desc("arithmetic intensity (FLOPs per byte the block must move)")
            .y_desc("achieved GFLOP/s")
            .axis_desc_style(text(13.0, INK, HPos::Center, VPos::Center))
            .label_style(text(12.0, INK, HPos::Center, VPos::Center))
            .bold_line_style(RGBColor(0xe6, 0xe6, 0xe6))
            .light_line_style(TRANSPARENT)
            .draw()?;
        let steps = 200;
        for (name, peak) in &peaks {
            // min(peak, bandwidth · intensity), in log units.
            let line: Vec<(f64, f64)> = (0..=steps)
                .map(|i| {
                    let x = x0 + (x1 - x0) * i as f64 / steps as f64;
                    let y = bw.map_or(peak.log10(), |bw| (bw * 10f64.powf(x)).min(*peak).log10());
                    (x, y)
                })
                .filter(|(_, y)| *y >= y0)
                .collect();
            chart.draw_series([PathElement::new(line, INK.stroke_width(2))])?;
            chart.draw_series([EmptyElement::at((x1, peak.log10()))
                + Text::new(format!("{name} peak {:.0} GFLOP/s", peak), (-6, -4), text(12.0, INK, HPos::Right, VPos::Bottom))])?;
        }
        if let (Some(bw), true) = (bw, peaks.is_empty()) {
            let line: Vec<(f64, f64)> = [x0, x1].iter().map(|&x| (x, (bw * 10f64.powf(x)).log10())).collect();
            chart.draw_series([PathElement::new(line, INK.stroke_width(2))])?;
        }
        if let Some(bw) = bw {
            let x = x0 + 0.2;
            chart.draw_series([EmptyElement::at((x, (bw * 10f64.powf(x)).log10()))
                + Text::new(format!("memory {bw:.0} GB/s"), (4, -6), text(12.0, INK, HPos::Left, VPos::Bottom))])?;
        }
        // Points that land on (nearly) the same pixel, such as stages 0 and 1 at fp32 on a CPU,
        // are fanned out sideways and their labels stacked, so each stays visible.
        let pixels: Vec<(i32, i32)> = pts.iter().map(|p| chart.backend_coord(&(p.intensity.log10(), p.gflops.log10()))).collect();
        for (i, p) in pts.iter().enumerate() {
            let c = crate::chart::stage_colour(&p.stage, i);
            let (before, after) = (overlapping_before(&pixels, i) as i32, overlapping_after(&pixels, i) as i32);
            let (px, py) = pixels[i];
            let at = (px + 10 * before, py);
            let marker = if p.emulated { c.stroke_width(2) } else { c.filled() };
            root.draw(&Circle::new(at, 6, marker))?;
            // Labels start right of the cluster's last marker, one line per point.
            let label = format!("{} {}{}", p.stage, p.precision, if p.emulated { " (emulated)" } else { "" });
            root.draw(&Text::new(label, (at.0 + 10 * after + 9, py + 16 * before), text(12.0, INK, HPos::Left, VPos::Center)))?;
        }
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shared::Preset;

    #[test]
    fn fusion_and_fused_attention_raise_intensity() {
        let s = Preset::Small.shape();
        let stages = crate::default_stages();
        let traffic = |i: usize, p: Precision, act: f64| stages[i].traffic(&s, p, act);
        let t: Vec<f64> = (0..4).map(|i| traffic(i, Precision::Fp32, 4.0)).collect();
        assert!(t[0] > t[2] && t[2] > t[3], "{t:?}");
        // GEMM bytes alone are a lower bound: weights (4C² + 2·C·FF) once, in f32.
        let (c, ff) = (s.d_model as f64, s.ff as f64);
        assert!(t[3] > 4.0 * (4.0 * c * c + 2.0 * c * ff));
        // FP8 operands: 1 byte; with f32 activations the quantising pass (read f32, write E4M3)
        // costs more than the operands save, so stage 4 moves more bytes than stage 3 on a CPU.
        assert!(traffic(4, Precision::Fp8, 4.0) > t[3]);
    }

    #[test]
    fn points_on_one_pixel_are_fanned_out() {
        let px = [(100, 100), (105, 96), (300, 100), (101, 101)];
        let k: Vec<usize> = (0..px.len()).map(|i| overlapping_before(&px, i)).collect();
        assert_eq!(k, vec![0, 1, 0, 2]);
        let k: Vec<usize> = (0..px.len()).map(|i| overlapping_after(&px, i)).collect();
        assert_eq!(k, vec![2, 1, 0, 0]);
    }
}
