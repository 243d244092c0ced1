//! Unit tests of `ladder/src/roofline.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

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
    let (before, after): (Vec<i32>, Vec<i32>) = (0..px.len()).map(|i| overlapping(&px, i)).unzip();
    assert_eq!(before, vec![0, 1, 0, 2]);
    assert_eq!(after, vec![2, 1, 0, 0]);
}

/// The recorded CPU run: each part sits under its own precision's roof — fp32 rows' parts under
/// the f32 GEMM rate, bf16 rows' under the bf16 one — and its point is its regime cell's.
#[test]
fn each_part_is_placed_under_its_own_precisions_roof() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../results/ladder-cpu.json");
    let report: LadderReport = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let pts = part_points(&report);
    let parts: usize = report.records.iter().map(|r| r.breakdown.as_ref().map_or(0, |b| b.parts.len())).sum();
    assert_eq!(pts.len(), parts, "every part of every row");
    let ceiling = report.records[0].ceiling.as_ref().unwrap();
    let bf16 = ceiling.bf16.as_ref().unwrap().gemm_gflops;
    for (p, r) in
        pts.iter().zip(report.records.iter().flat_map(|r| r.breakdown.iter().flat_map(move |b| b.parts.iter().map(move |p| (r, p)))))
    {
        let (rec, part) = r;
        let g = part.regime.as_ref().unwrap();
        let want = match rec.precision {
            Precision::Bf16 => bf16,
            _ => ceiling.gemm_gflops,
        };
        assert!((p.compute_roof - want).abs() < 1e-6 * want, "{} {}: roof {} want {want}", p.stage, p.part, p.compute_roof);
        assert!((p.memory_roof - ceiling.bandwidth_gbs).abs() < 1e-6 * ceiling.bandwidth_gbs);
        assert_eq!((p.intensity, p.gflops), (g.flops / g.min_bytes, g.gflops));
        assert_eq!(p.tag, shared::regime::tag(g));
    }
    // Two roofs, named by the precisions under them and labelled with the probe's rates; stage
    // 0's attention, which the README calls U, is drawn as U.
    let roofs = part_roofs(&pts);
    assert_eq!(roofs.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(), ["fp32/fp8 (emulated)", "bf16"]);
    let attention = pts.iter().find(|p| p.stage == "stage0_baseline" && p.part == "attention").unwrap();
    assert!(attention.tag.starts_with('U') && attention.precision == "fp32", "{attention:?}");
    let svg = parts_roofline_svg(&report).unwrap();
    let (f32_label, bf16_label) =
        (format!("fp32/fp8 (emulated) roof {:.0} GFLOP/s", ceiling.gemm_gflops), format!("bf16 roof {bf16:.0} GFLOP/s"));
    assert!(svg.contains(&f32_label) && svg.contains(&bf16_label), "roof labels: {f32_label}, {bf16_label}");
    // docs/roofline.svg is this chart of this JSON, exactly (CI draws it again and diffs it too).
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/roofline.svg")).unwrap();
    assert!(
        committed == svg,
        "docs/roofline.svg is not what results/ladder-cpu.json draws. Fix: cargo run --release -p ladder -- render --from results/ladder-cpu.json --parts-roofline docs/roofline.svg"
    );
}
