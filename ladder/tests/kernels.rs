//! Every row runs what its label says. `--breakdown` records, per part, the kernels each code path
//! named when it executed (`cpu_kernels::trace`); here, at `tiny` on the CPU, for fp32 and bf16,
//! every stage and every `--ablate` variant is run and its recorded kernels are held against its
//! label and against its neighbours: stage 2's parts other than attention run exactly stage 1's
//! kernels, stage 3 with every fusion off runs exactly stage 2's, each "without X" row differs
//! from stage 3 only in the parts X touches and runs stage 2's kernels there, and the element-wise
//! work runs on the engine's passes everywhere except the row that says it does not.

use shared::breakdown::Breakdown;
use shared::report::{LadderReport, Record};
use std::collections::BTreeMap;

#[path = "support/tiny_run.rs"]
mod tiny_run;

fn run(name: &str, extra: &[&str]) -> LadderReport {
    tiny_run::run_tiny(&format!("kernels-{name}"), extra)
}

/// part name → the kernels it ran.
fn parts(r: &Record) -> BTreeMap<String, Vec<String>> {
    let b: &Breakdown = r.breakdown.as_ref().unwrap_or_else(|| panic!("{} has no breakdown", r.stage));
    b.parts.iter().map(|p| (p.name.clone(), p.kernels.clone())).collect()
}

fn stage<'a>(r: &'a LadderReport, name: &str) -> &'a Record {
    r.records.iter().find(|x| x.stage == name).unwrap_or_else(|| panic!("no {name} row"))
}

fn variant<'a>(r: &'a LadderReport, against: &str, change: &str) -> &'a Record {
    let a = r.ablation.iter().find(|a| a.against == against && a.change == change);
    &a.unwrap_or_else(|| panic!("no {against} '{change}' row: {:?}", r.ablation.iter().map(|a| &a.change).collect::<Vec<_>>())).record
}

/// The element-wise kernels of a part list (the engine's passes or candle's ops).
fn elementwise(kernels: &[String]) -> Vec<&String> {
    kernels.iter().filter(|k| ["add:", "cast:", "layer_norm:", "gelu:"].iter().any(|p| k.starts_with(p))).collect()
}

fn label(r: &Record) -> String {
    r.implementation.clone().unwrap_or_default()
}

#[test]
fn every_row_runs_what_its_label_says() {
    for precision in ["fp32", "bf16"] {
        let r = run(precision, &["--precision", precision, "--ablate"]);
        let (s0, s1, s2, s3) =
            (stage(&r, "stage0_baseline"), stage(&r, "stage1_tensorcore"), stage(&r, "stage2_sdpa"), stage(&r, "stage3_fused"));
        let (p1, p2, p3) = (parts(s1), parts(s2), parts(s3));

        // Every part of every row ran something, and named it.
        for rec in r.records.iter().chain(r.ablation.iter().map(|a| &a.record)) {
            for (part, kernels) in parts(rec) {
                assert!(!kernels.is_empty(), "{precision} {} {:?} part {part}: no kernel recorded", rec.stage, rec.variant);
            }
        }

        // Element-wise work on the engine's passes in every row but the one labelled otherwise;
        // that one runs candle's ops for all of it.
        for rec in r.records.iter().chain(r.ablation.iter().map(|a| &a.record)) {
            let candle_row = rec.variant.as_deref() == Some("candle's element-wise ops");
            assert_eq!(label(rec).contains("candle's element-wise ops"), candle_row, "{precision} {}: {}", rec.stage, label(rec));
            for (part, kernels) in parts(rec) {
                for k in elementwise(&kernels) {
                    let want = if candle_row { ": candle" } else { ": engine pass" };
                    assert!(k.contains(want), "{precision} {} {:?} part {part}: {k} (want{want})", rec.stage, rec.variant);
                }
            }
        }
        let s0_candle = variant(&r, "stage0_baseline", "candle's element-wise ops");
        assert_eq!(parts(s0).keys().collect::<Vec<_>>(), parts(s0_candle).keys().collect::<Vec<_>>());

        // Stage 1: its GEMMs are the ones its label names.
        let gemms1: Vec<&String> = p1.values().flatten().filter(|k| k.starts_with("gemm")).collect();
        assert!(!gemms1.is_empty());
        match label(s1).split("bf16 GEMMs ").nth(1).map(|rest| rest.split(',').next().unwrap_or(rest).to_string()) {
            Some(kernel) => {
                assert!(gemms1.iter().all(|k| k.contains(&format!("gemm bf16: {kernel}"))), "{precision}: {gemms1:?} vs {}", label(s1))
            }
            None if precision == "fp32" => assert!(gemms1.iter().all(|k| k.starts_with("gemm f32")), "{gemms1:?}"),
            None => assert!(gemms1.iter().all(|k| k.contains("converted to f32")), "{precision}: {gemms1:?} vs {}", label(s1)),
        }

        // Stage 2 = stage 1 + fused attention: every other part runs exactly stage 1's kernels.
        assert_eq!(p1.keys().collect::<Vec<_>>(), p2.keys().collect::<Vec<_>>());
        for (part, kernels) in &p1 {
            if part != "attention" {
                assert_eq!(kernels, &p2[part], "{precision}: stage 2's {part} is not stage 1's");
            }
        }
        assert!(p1["attention"].iter().any(|k| k.contains("materialised scores")), "{:?}", p1["attention"]);
        let attn2 = &p2["attention"];
        assert!(attn2.len() == 1 && attn2[0].starts_with("attention: register-blocked"), "{precision}: {attn2:?}");
        assert!(label(s2).contains("register-blocked CPU kernel"), "{}", label(s2));
        if label(s2).contains("bf16 attention avx512-bf16") || label(s2).contains("bf16 attention amx") {
            assert!(attn2[0].contains("bf16 pairs"), "{precision}: label {} but ran {attn2:?}", label(s2));
            let amx = label(s2).contains("bf16 attention amx");
            assert_eq!(attn2[0].contains("(amx)"), amx, "{precision}: label {} but ran {attn2:?}", label(s2));
        } else {
            assert!(!attn2[0].contains("bf16 pairs"), "{precision}: label {} but ran {attn2:?}", label(s2));
        }

        // Stage 2's variants: the row-wise kernel in attention alone; the copies change no kernel.
        let row_wise = parts(variant(&r, "stage2_sdpa", "row-wise online softmax, no register tiles"));
        assert!(row_wise["attention"].iter().all(|k| k.contains("row-wise")), "{:?}", row_wise["attention"]);
        let copies = parts(variant(&r, "stage2_sdpa", "head split/merge copies kept"));
        for (part, kernels) in &p2 {
            assert_eq!(&copies[part], kernels, "{precision}: copies kept, part {part}");
            if part != "attention" {
                assert_eq!(&row_wise[part], kernels, "{precision}: row-wise, part {part}");
            }
        }

        // Stage 3: its own parts are fused ops; each "without X" differs only where X acts and
        // runs stage 2's kernels there.
        assert!(p3["ln1"].iter().all(|k| k.starts_with("fused layer_norm")), "{:?}", p3["ln1"]);
        assert!(p3["qkv"].len() == 1 && p3["qkv"][0].starts_with("fused linear") && !p3["qkv"][0].contains('×'), "{:?}", p3["qkv"]);
        assert!(p3["proj+residual+ln2"].iter().any(|k| k.starts_with("fused add+layer_norm")), "{:?}", p3["proj+residual+ln2"]);
        let same_but = |v: &BTreeMap<String, Vec<String>>, changed: &[&str], what: &str| {
            for (part, kernels) in &p3 {
                if !changed.contains(&part.as_str()) {
                    assert_eq!(&v[part], kernels, "{precision} stage 3 {what}: part {part} changed");
                }
            }
        };
        let no_ln = parts(variant(&r, "stage3_fused", "without ln"));
        same_but(&no_ln, &["ln1"], "without ln");
        assert_eq!(no_ln["ln1"], p2["ln1"], "{precision}: without ln, ln1 is stage 2's");
        let no_qkv = parts(variant(&r, "stage3_fused", "without qkv"));
        same_but(&no_qkv, &["qkv"], "without qkv");
        assert!(no_qkv["qkv"].len() == 1 && no_qkv["qkv"][0].ends_with("×3"), "{:?}", no_qkv["qkv"]);
        let no_epilogue = parts(variant(&r, "stage3_fused", "without epilogue"));
        same_but(&no_epilogue, &["qkv", "proj+residual+ln2", "fc1+gelu", "fc2+residual"], "without epilogue");
        assert_eq!(no_epilogue["fc1+gelu"], p2["fc1+gelu"], "{precision}: without epilogue, fc1+gelu is stage 2's");
        assert_eq!(no_epilogue["fc2+residual"], p2["fc2+residual"], "{precision}: without epilogue, fc2+residual is stage 2's");
        assert!(!no_epilogue.values().flatten().any(|k| k.starts_with("fused linear")), "{no_epilogue:?}");
        let no_add_ln = parts(variant(&r, "stage3_fused", "without add-ln"));
        assert!(no_add_ln.contains_key("proj+residual") && no_add_ln.contains_key("ln2") && !no_add_ln.contains_key("proj+residual+ln2"));
        assert!(no_add_ln["proj+residual"].iter().any(|k| k.starts_with("add: engine pass")), "{:?}", no_add_ln["proj+residual"]);
        assert_eq!(no_add_ln["ln2"], p3["ln1"], "{precision}: without add-ln, ln2 is stage 3's one-pass LayerNorm");
        for part in ["ln1", "qkv", "attention", "fc1+gelu", "fc2+residual"] {
            assert_eq!(no_add_ln[part], p3[part], "{precision} without add-ln: part {part} changed");
        }

        // Stage 4 (emulated on a CPU): its GEMMs say FP8.
        let p4 = parts(stage(&r, "stage4_fp8"));
        assert!(p4["qkv"].iter().any(|k| k.starts_with("fp8 gemm: emulated")), "{:?}", p4["qkv"]);
        assert_eq!(p4["attention"], p3["attention"], "{precision}: stage 4's attention is stage 3's");
    }
}

#[test]
fn stage_3_with_every_fusion_off_runs_exactly_stage_2s_kernels() {
    for precision in ["fp32", "bf16"] {
        let r = run(&format!("none-{precision}"), &["--precision", precision, "--stages", "2,3", "--fusions", "none"]);
        let (p2, p3) = (parts(stage(&r, "stage2_sdpa")), parts(stage(&r, "stage3_fused")));
        assert_eq!(p2, p3, "{precision}: stage 3 with --fusions none is not stage 2");
    }
}
