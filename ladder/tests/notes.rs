//! Every row's notes say what its forward ran. The runner observes the checked forward
//! (`shared::ran`) and writes the notes from it; here every stage (and every `--ablate` row) is
//! run at `tiny` on the CPU for fp32 and bf16, and its notes are held against the precision
//! (the dtype attention takes in), against the kernels `--breakdown` recorded on its own timed
//! forwards (GEMMs and attention), and against what each stage's lesson is.

use shared::ran::{is_elementwise, is_gemm};
use shared::report::{LadderReport, Record};
use std::process::Command;

#[path = "support/tiny_run.rs"]
mod tiny_run;

fn run(precision: &str) -> LadderReport {
    tiny_run::run_tiny(&format!("notes-{precision}"), &["--ablate", "--precision", precision])
}

/// The note that starts with `prefix`, without it.
fn note<'a>(r: &'a Record, prefix: &str) -> &'a str {
    let found = r.notes.iter().find_map(|n| n.strip_prefix(prefix));
    found.unwrap_or_else(|| panic!("{} {:?}: no note \"{prefix}…\" in {:#?}", r.stage, r.variant, r.notes))
}

/// The dtype the note says attention took in ("bf16 into qkv, attention, …" → "bf16").
fn attention_dtype(r: &Record) -> String {
    let groups = note(r, "ran: activations ").split("; ");
    let g = groups.clone().find(|g| g.split(" into ").nth(1).is_some_and(|parts| parts.split(", ").any(|p| p == "attention")));
    g.unwrap_or_else(|| panic!("{} {:?}: attention's dtype not named: {:?}", r.stage, r.variant, r.notes)).split(' ').next().unwrap().into()
}

/// Kernel names without their counts, each once, in order.
fn names<'a>(kernels: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in kernels {
        let k = k.rsplit_once(" ×").filter(|(_, n)| n.parse::<usize>().is_ok()).map_or(k.as_str(), |(k, _)| k);
        if !out.iter().any(|o| o == k) {
            out.push(k.to_string());
        }
    }
    out
}

/// The GEMM kernels the note names, and attention's.
fn noted(r: &Record) -> (Vec<String>, String) {
    let gemms = note(r, "ran: GEMMs by kernel: ").split("; ").map(|g| g.rsplit_once(" (").map_or(g, |(k, _)| k).to_string()).collect();
    (gemms, note(r, "ran: attention kernel ").to_string())
}

#[test]
fn every_rows_notes_name_the_dtype_gemms_and_attention_it_ran() {
    for precision in ["fp32", "bf16"] {
        let r = run(precision);
        assert_eq!(r.records.len(), 5, "{precision}: every stage ran: {:?}", r.skipped);
        let stage3 = r.records.iter().find(|x| x.stage == "stage3_fused").unwrap();
        for rec in r.records.iter().chain(r.ablation.iter().map(|a| &a.record)) {
            let what = format!("{precision} {} {:?}", rec.stage, rec.variant);
            // Activations: stage 0 is fp32 whatever is asked; stages 1–3 run the request; stage 4
            // keeps stage 3's activations, only its GEMMs are FP8.
            let want = match rec.stage.as_str() {
                "stage0_baseline" => "f32".to_string(),
                "stage4_fp8" => attention_dtype(stage3),
                _ if precision == "bf16" => "bf16".into(),
                _ => "f32".into(),
            };
            assert_eq!(attention_dtype(rec), want, "{what}: {:?}", rec.notes);

            // The GEMMs and attention the note names are those --breakdown recorded on the
            // timed forwards, a second recording of the same code paths.
            let (gemms, attention) = noted(rec);
            let parts = &rec.breakdown.as_ref().unwrap_or_else(|| panic!("{what}: no breakdown")).parts;
            let recorded_gemms = names(parts.iter().flat_map(|p| &p.kernels).filter(|k| is_gemm(k)));
            assert_eq!(gemms, recorded_gemms, "{what}");
            let attn = parts.iter().find(|p| p.name == "attention").unwrap();
            let recorded_attention = names(attn.kernels.iter().filter(|k| !is_gemm(k) && !is_elementwise(k)));
            let recorded_attention: Vec<String> =
                recorded_attention.iter().map(|k| k.strip_prefix("attention: ").unwrap_or(k).to_string()).collect();
            assert_eq!(attention, recorded_attention.join("; "), "{what}");

            // And each is the stage's lesson: stage 0/1 materialise the scores, 2–4 run the fused
            // kernel; GEMMs in the precision's format, stage 3's fused linears, stage 4's FP8.
            let fused_attention = !matches!(rec.stage.as_str(), "stage0_baseline" | "stage1_tensorcore");
            assert_eq!(!attention.contains("materialised scores"), fused_attention, "{what}: {attention}");
            let gemm = match rec.stage.as_str() {
                "stage0_baseline" => "gemm f32",
                "stage4_fp8" => "fp8 gemm",
                "stage3_fused" if rec.variant.as_deref() != Some("without epilogue") => "fused linear",
                _ if precision == "bf16" => "gemm bf16",
                _ => "gemm f32",
            };
            assert!(gemms.iter().any(|g| g.starts_with(gemm)), "{what}: {gemms:?} (want {gemm})");
        }
    }
}

/// A training row's notes say what its forward ran too: at bf16 on a CPU with a bf16 unit the
/// autograd's tensors stay f32 (`precision::trains_f32_on_cpu`) while the GEMMs multiply bf16,
/// and the note says exactly that rather than the precision's name.
#[test]
fn a_training_rows_notes_name_what_its_forward_ran() {
    let json = std::env::temp_dir().join(format!("speedkit-notes-train-{}.json", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args([
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--train",
            "--stages",
            "0,1,3",
            "--precision",
            "bf16",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let r: LadderReport = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    let native = cpu_kernels::bf16_gemm::Kernel::detect().is_native();
    for rec in &r.records {
        let (want, gemm) = match rec.stage.as_str() {
            "stage0_baseline" => ("f32", "f32"),
            _ if native => ("f32", "bf16"),
            _ => ("bf16", "bf16"),
        };
        assert_eq!(attention_dtype(rec), want, "{} (bf16 unit: {native}): {:?}", rec.stage, rec.notes);
        let (gemms, _) = noted(rec);
        assert!(gemms.iter().all(|g| g.contains(gemm)), "{}: {gemms:?} (want {gemm})", rec.stage);
    }
}
