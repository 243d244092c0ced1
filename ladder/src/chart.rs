//! Charts for the README and sweeps, drawn with plotters' SVG backend. Text is SVG `<text>` (plotters without its
//! `ttf` feature), so neither building nor drawing needs font files; the viewer's sans-serif font renders it.

use crate::provenance::date_utc;
use crate::render::{axis_symbol, describe_device, part_names, sweep_stages};
use itertools::Itertools;
use plotters::chart::MeshStyle;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use shared::report::{fmt_ms, fmt_rel_err};
use shared::report::{LadderReport, Mode, Record, Row, SweepReport};

pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Bars<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

const fn rgb(hex: u32) -> RGBColor {
    RGBColor((hex >> 16) as u8, (hex >> 8) as u8, hex as u8)
}

/// One colour per stage number, the same in every chart (stage 0, the baseline, is grey).
static COLOURS: [RGBColor; 6] = [rgb(0x888888), rgb(0x1f77b4), rgb(0xff7f0e), rgb(0x2ca02c), rgb(0x9467bd), rgb(0xd62728)];
pub(crate) const INK: RGBColor = rgb(0x222222);
pub(crate) const MUTED: RGBColor = rgb(0x666666);
pub(crate) const GRID: RGBColor = rgb(0xe6e6e6);
const FAIL: RGBColor = rgb(0xb00020);
const HALF: f64 = 0.32;

/// The stage's colour in every chart, by the number in its name ("stage2_sdpa" → 2), else position.
pub fn stage_colour(stage: &str, position: usize) -> RGBColor {
    let n = stage.strip_prefix("stage").and_then(|s| s.split('_').next()).and_then(|n| n.parse().ok()).unwrap_or(position);
    COLOURS[n % COLOURS.len()]
}

/// Text of `size` px. (plotters' SVG backend writes font-size = size / 1.24, hence the factor.)
pub(crate) fn text(size: f64, colour: RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    TextStyle { font: ("sans-serif", size * 1.24).into_font(), color: colour.to_backend_color(), pos: Pos::new(h, v) }
}

fn bold(size: f64, colour: RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    TextStyle { font: ("sans-serif", size * 1.24, FontStyle::Bold).into_font(), ..text(size, colour, h, v) }
}

pub(crate) fn svg(size: (u32, u32), draw: impl FnOnce(&Area) -> anyhow::Result<()>) -> anyhow::Result<String> {
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
    root.fill(&WHITE)?;
    draw(&root)?;
    root.present()?;
    drop(root);
    Ok(svg)
}

pub(crate) fn heading(root: &Area, title: &str, style: TextStyle, facts: &[String]) -> anyhow::Result<()> {
    root.draw(&Text::new(title, (20, 12), style))?;
    for (i, line) in facts.iter().enumerate() {
        root.draw(&Text::new(line.as_str(), (20, 36 + 17 * i as i32), text(12.0, MUTED, HPos::Left, VPos::Top)))?;
    }
    Ok(())
}

/// "shape · commit … · date" under a chart's title.
pub(crate) fn facts(shape: impl std::fmt::Display, report: &LadderReport) -> String {
    format!("{shape} · commit {} · {}", report.commit, date_utc(report.unix_time))
}

/// The axis text and grid every chart here shares; `grid` colours the major lines, and with `x_labels` 0 there are
/// no vertical lines nor x labels (the caller labels its columns).
pub(crate) fn mesh<'a, 'b, X, Y, DB>(
    chart: &'b mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    grid: impl Into<ShapeStyle>,
    x_labels: usize,
) -> MeshStyle<'a, 'b, X, Y, DB>
where
    X: Ranged + ValueFormatter<X::ValueType>,
    Y: Ranged + ValueFormatter<Y::ValueType>,
    DB: DrawingBackend,
{
    let mut m = chart.configure_mesh();
    m.axis_desc_style(text(13.0, INK, HPos::Center, VPos::Center))
        .label_style(text(12.0, INK, HPos::Center, VPos::Center))
        .bold_line_style(grid)
        .light_line_style(TRANSPARENT)
        .x_labels(x_labels);
    if x_labels == 0 {
        m.disable_x_mesh();
    }
    m
}

/// A bar chart: `n` slots, ms from 0 to `y_max`, no x labels (each bar labels itself).
fn bar_chart<'a, 'b>(area: &'a Area<'b>, x_label_area: u32, n: usize, y_max: f64, y_desc: &str) -> anyhow::Result<Bars<'a, 'b>> {
    let mut chart =
        ChartBuilder::on(area).x_label_area_size(x_label_area).y_label_area_size(64).build_cartesian_2d(0f64..n as f64, 0f64..y_max)?;
    // Tick labels with as many decimals as the axis' scale needs: 0 from 20 ms, 1 from 2 ms, else 2.
    let digits = [20.0, 2.0].iter().filter(|&&t| y_max < t).count();
    mesh(&mut chart, GRID, 0).y_labels(6).y_desc(y_desc).y_label_formatter(&|v| format!("{v:.digits$}")).draw()?;
    Ok(chart)
}

fn label_bar(root: &Area, (px, py): (i32, i32), stage: &str, precision: String) -> anyhow::Result<()> {
    root.draw(&Text::new(stage, (px, py + 8), bold(12.0, INK, HPos::Center, VPos::Top)))?;
    root.draw(&Text::new(precision, (px, py + 25), text(12.0, INK, HPos::Center, VPos::Top)))?;
    Ok(())
}

pub(crate) fn note(chart: &mut Bars, at: (f64, f64), offset: (i32, i32), label: impl Into<String>, style: TextStyle) -> anyhow::Result<()> {
    chart.draw_series([EmptyElement::at(at) + Text::new(label.into(), offset, style)])?;
    Ok(())
}

/// Whether a record ran an emulation (stage 4 on a CPU): a time that is not the technique's speed.
pub(crate) fn is_emulated(r: &Record) -> bool {
    r.implementation.as_deref().is_some_and(|i| i.starts_with(shared::stage::EMULATED))
}

/// The ladder chart: a bar per stage (median, p10–p90 whisker, speedup over stage 0; precision and error under it).
pub fn ladder_svg(report: &LadderReport) -> anyhow::Result<String> {
    let rows = report.rows();
    let n = rows.len().max(1);
    let top = report.records.iter().map(|r| r.timing.p90_ms.max(r.timing.median_ms)).fold(0.0, f64::max);
    let y_max = if top > 0.0 { top * 1.3 } else { 1.0 };
    svg(((175 * n as u32 + 130).max(800), 560), |root| {
        let per = if report.mode() == Some(Mode::Train) { "training step (forward + backward)" } else { "forward" };
        let s0 = report.records.iter().any(|r| r.speedup_vs_stage0.is_some());
        let speedups = if s0 { "speedup over stage 0 on each bar" } else { "stage 0 did not run, so no speedups" };
        let title = format!("Median ms per {per} (lower is better); {speedups}");
        heading(root, &title, bold(16.0, INK, HPos::Left, VPos::Top), &[describe_device(report), facts(report.shape, report)])?;
        let body = root.margin(74, 14, 8, 20);
        let mut chart = bar_chart(&body, 78, n, y_max, &format!("median ms per {per} (whisker: p10–p90)"))?;
        for (i, row) in rows.iter().enumerate() {
            let x = i as f64 + 0.5;
            let c = stage_colour(row.stage(), i);
            let frame = |top: f64| vec![(x - HALF, 0.0), (x - HALF, top), (x + HALF, top), (x + HALF, 0.0)];
            match row {
                Row::Ran(r) => {
                    let t = &r.timing;
                    // An emulation's bar is light grey, outlined in the stage's colour: never read as a speed.
                    let fill = if is_emulated(r) { rgb(0xe4e4e4) } else { c };
                    chart.draw_series([Rectangle::new([(x - HALF, 0.0), (x + HALF, t.median_ms)], fill.filled())])?;
                    if is_emulated(r) {
                        chart.draw_series([PathElement::new(frame(t.median_ms), c.stroke_width(2))])?;
                    }
                    let caps = [[(x - 0.06, t.p10_ms), (x + 0.06, t.p10_ms)], [(x - 0.06, t.p90_ms), (x + 0.06, t.p90_ms)]];
                    chart.draw_series([PathElement::new(vec![(x, t.p10_ms), (x, t.p90_ms)], INK.stroke_width(1))])?;
                    chart.draw_series(caps.iter().map(|cap| PathElement::new(cap.to_vec(), INK.stroke_width(1))))?;
                    let at = (x, t.p90_ms.max(t.median_ms));
                    let ms = format!("{} ms", fmt_ms(t.median_ms));
                    note(&mut chart, at, (0, -5), ms, text(12.0, MUTED, HPos::Center, VPos::Bottom))?;
                    if let Some(s) = r.speedup_vs_stage0 {
                        // "≈1.0x" when the p10–p90 intervals overlap stage 0's: within noise.
                        let label = shared::report::speedup_text(Some(s), r.noise_vs_stage0);
                        note(&mut chart, at, (0, -22), label, bold(15.0, INK, HPos::Center, VPos::Bottom))?;
                    }
                    if is_emulated(r) {
                        note(&mut chart, at, (0, -42), "emulated: not its speed", text(11.0, MUTED, HPos::Center, VPos::Bottom))?;
                    }
                }
                Row::Skipped(s) => {
                    let (word, ink) = if s.failed { ("FAILED check", FAIL) } else { ("skipped", MUTED) };
                    chart.draw_series([PathElement::new(frame(y_max * 0.25), ink.stroke_width(1))])?;
                    note(&mut chart, (x, y_max * 0.125), (0, 0), word, text(13.0, ink, HPos::Center, VPos::Center))?;
                }
            }
            let (px, py) = chart.backend_coord(&(x, 0.0));
            let (precision, implementation, error) = match row {
                Row::Ran(r) => (r.precision.to_string(), r.implementation.as_deref(), format!("rel err {}", fmt_rel_err(r))),
                Row::Skipped(s) => ("–".into(), None, if s.failed { "failed its check" } else { "not measured" }.into()),
            };
            label_bar(root, (px, py), row.stage(), precision)?;
            if let Some(i) = implementation {
                root.draw(&Text::new(format!("({i})"), (px, py + 41), text(11.0, INK, HPos::Center, VPos::Top)))?;
            }
            root.draw(&Text::new(error, (px, py + 57), text(12.0, MUTED, HPos::Center, VPos::Top)))?;
        }
        Ok(())
    })
}

/// The shape's dimensions other than the swept one (and those that follow it in a d_model sweep).
fn shape_without(s: &shared::Shape, axis: &str) -> String {
    let c = "d_model";
    let dims = [("B", s.batch, "batch"), ("T", s.seq, "seq"), ("C", s.d_model, c), ("n_head", s.n_head, c), ("FF", s.ff, c)];
    dims.iter().filter(|(_, _, a)| *a != axis).map(|(n, v, _)| format!("{n}={v}")).join(" ")
}

/// A line through `points` (x = value index), broken where the stage did not run, never bridging it.
fn segments(points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    for &p in points {
        match out.last_mut() {
            Some(seg) if seg.last().is_some_and(|q| p.0 - q.0 == 1.0) => seg.push(p),
            _ => out.push(vec![p]),
        }
    }
    out
}

/// 1, 2, 5 × 10^n within [lo, hi]: plotters' own log ticks are decades only, too few for one decade.
fn ticks_125(lo: f64, hi: f64) -> Vec<f64> {
    let decades = std::iter::successors(Some(10f64.powf(lo.log10().floor())), |d| Some(d * 10.0)).take_while(|&d| d <= hi);
    decades.flat_map(|d| [1.0, 2.0, 5.0].map(|m| m * d)).filter(|t| (lo..=hi).contains(t)).collect()
}

/// The swept values under a panel's x axis, `at` giving a value index's pixel on it.
fn value_labels(root: &Area, values: &[usize], at: impl Fn(f64) -> (i32, i32)) -> anyhow::Result<()> {
    for (j, v) in values.iter().enumerate() {
        let (px, py) = at(j as f64);
        root.draw(&Text::new(v.to_string(), (px, py + 6), text(12.0, INK, HPos::Center, VPos::Top)))?;
    }
    Ok(())
}

/// The sweep chart: median ms per stage (log scale) over the swept values; below, each one's speedup over stage 0.
pub fn sweep_svg(sweep: &SweepReport) -> anyhow::Result<String> {
    let k = sweep.values.len().max(1);
    let h = 760u32;
    let stages = sweep_stages(sweep);
    let series: Vec<Vec<(usize, &Record)>> = stages
        .iter()
        .map(|stage| {
            sweep.runs.iter().enumerate().filter_map(|(j, run)| run.records.iter().find(|r| &r.stage == stage).map(|r| (j, r))).collect()
        })
        .collect();
    let all = series.iter().flatten();
    let (lo, hi) = all.clone().map(|(_, r)| r.timing.median_ms).fold((f64::INFINITY, 0.0f64), |(lo, hi), m| (lo.min(m), hi.max(m)));
    let (lo, hi) = if hi > 0.0 { (lo * 0.6, hi * 1.8) } else { (0.1, 1.0) };
    let s_max = all.filter_map(|(_, r)| r.speedup_vs_stage0).fold(1.0f64, f64::max) * 1.2;
    let x_range = || -0.5f64..k as f64 - 0.5;
    let x_desc = crate::render::AXES.iter().find(|a| a.0 == sweep.axis).map_or(sweep.axis.clone(), |a| format!("{} ({})", a.1, a.2));
    let across = |y: f64, style: ShapeStyle| PathElement::new(vec![(-0.5, y), (k as f64 - 0.5, y)], style);
    svg(((110 * k as u32 + 300).max(800), h), |root| {
        let per = if sweep.runs.first().and_then(|r| r.mode()) == Some(Mode::Train) { " per training step" } else { "" };
        let title = format!("Sweep over {}: median ms{per} per stage, and its speedup over stage 0", axis_symbol(&sweep.axis));
        let facts = sweep.runs.first().map(|f| vec![describe_device(f), facts(shape_without(&f.shape, &sweep.axis), f)]);
        heading(root, &title, bold(16.0, INK, HPos::Left, VPos::Top), &facts.unwrap_or_default())?;
        let (upper, lower) = root.margin(74, 8, 8, 20).split_vertically(h / 2 - 40);

        let mut ms =
            ChartBuilder::on(&upper).x_label_area_size(40).y_label_area_size(64).build_cartesian_2d(x_range(), (lo..hi).log_scale())?;
        mesh(&mut ms, TRANSPARENT, 0)
            .x_desc(&x_desc)
            .y_desc(format!("median ms{per} (log scale)"))
            .y_label_formatter(&|_| String::new())
            .draw()?;
        for (i, (stage, points)) in stages.iter().zip(&series).enumerate() {
            let c = stage_colour(stage, i);
            let line: Vec<(f64, f64)> = points.iter().map(|(j, r)| (*j as f64, r.timing.median_ms)).collect();
            ms.draw_series(segments(&line).into_iter().map(|seg| PathElement::new(seg, c.stroke_width(2))))?
                .label(stage.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
            ms.draw_series(line.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
        value_labels(root, &sweep.values, |x| ms.backend_coord(&(x, lo)))?;
        // A value at which nothing ran (its shape cannot run here) says so where its points would be.
        for (j, _) in sweep.runs.iter().enumerate().filter(|(_, r)| r.records.is_empty()) {
            let (px, py) = ms.backend_coord(&(j as f64, lo));
            root.draw(&Text::new("not run (see table)", (px, py - 10), text(12.0, MUTED, HPos::Center, VPos::Bottom)))?;
        }
        for t in ticks_125(lo, hi) {
            ms.draw_series([across(t, GRID.stroke_width(1))])?;
            let (px, py) = ms.backend_coord(&(-0.5, t));
            root.draw(&Text::new(format!("{}", (t * 1e6).round() / 1e6), (px - 6, py), text(12.0, INK, HPos::Right, VPos::Center)))?;
        }
        ms.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(rgb(0xcccccc))
            .label_font(text(12.0, INK, HPos::Left, VPos::Center))
            .draw()?;

        let mut up = ChartBuilder::on(&lower).x_label_area_size(40).y_label_area_size(64).build_cartesian_2d(x_range(), 0f64..s_max)?;
        mesh(&mut up, GRID, 0)
            .x_desc(&x_desc)
            .y_desc("speedup over stage 0 (above 1 pays)")
            .y_label_formatter(&|v| format!("{v:.1}x"))
            .draw()?;
        value_labels(root, &sweep.values, |x| up.backend_coord(&(x, 0.0)))?;
        up.draw_series([across(1.0, COLOURS[0].stroke_width(2))])?;
        for (i, (stage, points)) in stages.iter().zip(&series).enumerate() {
            let c = stage_colour(stage, i);
            if c == COLOURS[0] {
                continue; // stage 0 is the line at 1
            }
            let line: Vec<(f64, f64)> = points.iter().filter_map(|(j, r)| r.speedup_vs_stage0.map(|s| (*j as f64, s))).collect();
            up.draw_series(segments(&line).into_iter().map(|seg| PathElement::new(seg, c.stroke_width(2))))?;
            up.draw_series(line.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
            // The last value's speedup, written at the line's end (every value's is in the table).
            if let Some(&(x, s)) = line.last() {
                note(&mut up, (x, s), (7, 0), format!("{s:.2}x"), text(12.0, c, HPos::Left, VPos::Center))?;
            }
        }
        Ok(())
    })
}

/// One colour per part of the block, a fused part's its own so it never reads as the part it
/// absorbed (longest name first, so "proj+residual+ln2" is not taken for "proj+residual").
fn part_colour(part: &str) -> RGBColor {
    const PART_COLOURS: [(&str, u32); 8] = [
        ("ln1", 0x9ec9e2),
        ("qkv", 0x2ca02c),
        ("attention", 0xff7f0e),
        ("proj+residual+ln2", 0x9467bd),
        ("proj+residual", 0xd62728),
        ("ln2", 0x1f77b4),
        ("fc1+gelu", 0xbcbd22),
        ("fc2+residual", 0x8c564b),
    ];
    rgb(PART_COLOURS.iter().find(|(name, _)| part.starts_with(name)).map_or(0x7f7f7f, |(_, c)| *c))
}

/// `--breakdown`'s chart: a bar of stacked parts per stage, a tick at the uninstrumented median.
pub fn breakdown_svg(report: &LadderReport) -> anyhow::Result<String> {
    let rows: Vec<&Record> = report.records.iter().filter(|r| r.breakdown.is_some()).collect();
    let n = rows.len().max(1);
    let w = (175 * n as u32 + 330).max(800);
    let top = rows.iter().filter_map(|r| r.breakdown.as_ref().map(|b| b.total_ms.max(r.timing.median_ms))).fold(0.0, f64::max);
    let y_max = if top > 0.0 { top * 1.15 } else { 1.0 };
    svg((w, 560), |root| {
        let train = report.mode() == Some(Mode::Train);
        let title = match train {
            true => "Where the time goes: ms per part of a training step, instrumented (a sync between forward and backward)",
            false => "Where the time goes: ms per part of the block, instrumented (a sync at each part boundary)",
        };
        let facts = format!("{} · black tick: the uninstrumented median", facts(report.shape, report));
        heading(root, title, bold(16.0, INK, HPos::Left, VPos::Top), &[describe_device(report), facts])?;
        let (body, legend) = root.margin(74, 14, 8, 20).split_horizontally(w as i32 - 230);
        let y_desc = if train { "ms per training step (instrumented)" } else { "ms per forward (instrumented)" };
        let mut chart = bar_chart(&body, 40, n, y_max, y_desc)?;
        for (i, r) in rows.iter().enumerate() {
            let b = r.breakdown.as_ref().expect("filtered above");
            let x = i as f64 + 0.5;
            let mut y = 0.0;
            for p in &b.parts {
                chart.draw_series([Rectangle::new([(x - HALF, y), (x + HALF, y + p.median_ms)], part_colour(&p.name).filled())])?;
                // A LayerNorm is often too thin to see (under 14 px): it is named beside the bar.
                let (_, bottom) = chart.backend_coord(&(x, y));
                let (_, top) = chart.backend_coord(&(x, y + p.median_ms));
                if p.name.starts_with("ln") && bottom - top < 14 {
                    let (left, mid) = chart.backend_coord(&(x - HALF, y + p.median_ms / 2.0));
                    root.draw(&Text::new(p.name.as_str(), (left - 4, mid), text(10.0, INK, HPos::Right, VPos::Center)))?;
                }
                y += p.median_ms;
            }
            let m = r.timing.median_ms;
            chart.draw_series([PathElement::new(vec![(x + HALF, m), (x + 0.42, m)], INK.stroke_width(3))])?;
            let label = format!("{} ms ({} ms)", fmt_ms(b.total_ms), fmt_ms(m));
            note(&mut chart, (x, y), (0, -5), label, text(12.0, MUTED, HPos::Center, VPos::Bottom))?;
            label_bar(root, chart.backend_coord(&(x, 0.0)), &r.stage, r.precision.to_string())?;
        }
        for (j, name) in part_names(&rows).iter().enumerate() {
            let y = 20 + 22 * j as i32;
            legend.draw(&Rectangle::new([(10, y), (26, y + 14)], part_colour(name).filled()))?;
            legend.draw(&Text::new(name.as_str(), (32, y + 7), text(12.0, INK, HPos::Left, VPos::Center)))?;
        }
        Ok(())
    })
}

#[cfg(test)]
#[path = "../tests/unit/chart.rs"]
mod tests;
