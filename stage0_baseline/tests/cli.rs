//! The stage binary as a user meets it: bad input gets exit code 2 and a message naming the
//! problem; good input gets a table, a JSON record, and files that round-trip.

use candle_core::{Device, Tensor};
use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_stage0_baseline");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("binary runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn expect_usage_error(args: &[&str], env: &[(&str, &str)], needle: &str) {
    let o = run(args, env);
    assert_eq!(o.status.code(), Some(2), "args {args:?}: {}", text(&o));
    assert!(text(&o).contains(needle), "args {args:?}: expected {needle:?} in:\n{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("speedkit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

const FAST: [&str; 6] = ["--preset", "tiny", "--warmup", "0", "--iters", "2"];

#[test]
fn bad_inputs_exit_2_with_the_reason() {
    expect_usage_error(&["--preset", "tiny", "--heads", "3"], &[], "not divisible by n_head = 3");
    expect_usage_error(&["--preset", "tiny", "--batch", "0"], &[], "--batch (B) is 0");
    expect_usage_error(&["--preset", "tiny", "--ff", "0"], &[], "--ff (FF) is 0");
    expect_usage_error(&["--preset", "huge"], &[], "invalid value 'huge'");
    expect_usage_error(&["--preset", "tiny", "--iters", "0"], &[], "--iters is 0");
    expect_usage_error(&["--preset", "tiny", "--device", "tpu"], &[], "not a device");
    expect_usage_error(&["--preset", "tiny", "--precision", "bf16"], &[], "fp32 only");
    expect_usage_error(&["--preset", "tiny", "--device", "cpu", "--cuda-graph"], &[], "--cuda-graph replays captured GPU work");
    // The same checks apply to values from the environment.
    expect_usage_error(&[], &[("SPEEDKIT_PRESET", "tiny"), ("SPEEDKIT_ITERS", "0")], "--iters is 0");
}

#[test]
fn score_matrix_past_32_bit_indexing_is_refused_before_allocating() {
    // B=4, T=8192, 12 heads: 3.2e9 scores (12 GiB in f32), beyond 32-bit GEMM indexing.
    expect_usage_error(&["--preset", "small", "--batch", "4", "--seq", "8192"], &[], "T x T scores grow with T squared");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_requested_in_cpu_build_names_the_feature() {
    expect_usage_error(&["--preset", "tiny", "--device", "cuda"], &[], "--features cuda");
}

#[test]
fn bad_weights_files() {
    expect_usage_error(&["--preset", "tiny", "--weights", "/nonexistent/w.safetensors"], &[], "cannot be read");
    let junk = tmp("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    expect_usage_error(&["--weights", junk.to_str().unwrap()], &[], "not a safetensors file");

    // A real layer file with one matrix of the wrong shape.
    let good = tmp("good.safetensors");
    let o = run(&[&FAST[..], &["--save-weights", good.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    let mut t = candle_core::safetensors::load(&good, &Device::Cpu).unwrap();
    t.insert("h.0.attn.c_attn.weight".into(), Tensor::zeros((128, 100), candle_core::DType::F32, &Device::Cpu).unwrap());
    let bad = tmp("misshaped.safetensors");
    candle_core::safetensors::save(&t, &bad).unwrap();
    expect_usage_error(&["--weights", bad.to_str().unwrap()], &[], "attn.c_attn.weight has shape [128, 100]");
    t.remove("h.0.mlp.c_fc.bias");
    candle_core::safetensors::save(&t, &bad).unwrap();
    expect_usage_error(&["--weights", bad.to_str().unwrap()], &[], "h.0.mlp.c_fc.bias is missing");
    expect_usage_error(&["--weights", good.to_str().unwrap(), "--layer", "3"], &[], "no layer 3");
    expect_usage_error(&["--weights", good.to_str().unwrap(), "--d-model", "64"], &[], "contradicts the weights file");
}

#[test]
fn json_record_holds_what_the_table_shows() {
    let path = tmp("record.json");
    let o = run(&[&FAST[..], &["--json", path.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for col in ["stage", "median ms", "GFLOP/s", "rel. error", "peak mem"] {
        assert!(out.contains(col), "{col} missing from\n{out}");
    }
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(j["schema"], "candle-speedkit/record/v2");
    assert_eq!(j["stage"], "stage0_baseline");
    assert_eq!(j["precision"], "fp32");
    assert_eq!(j["shape"]["d_model"], 128);
    assert_eq!(j["iters"], 2);
    assert_eq!(j["timing"]["samples_ms"].as_array().unwrap().len(), 2);
    let median = j["timing"]["median_ms"].as_f64().unwrap();
    assert!(median > 0.0);
    // The table prints the same median the record holds.
    assert!(out.contains(&format!("{} (", shared::report::fmt_ms(median))), "{out}");
    let flops = j["flops_per_forward"].as_f64().unwrap();
    assert_eq!(flops, 52_428_800.0);
    assert!((j["tflops"].as_f64().unwrap() - flops / (median / 1e3) / 1e12).abs() < 1e-9);
    assert_eq!(j["check"]["passed"], true);
    assert!(j["check"]["rel_err"].as_f64().unwrap() <= 1e-5);
    assert!(j["peak_mem_bytes"].as_u64().is_some());
    assert_eq!(j["gemm_switches"]["tf32"], false);
}

#[test]
fn output_and_input_files_round_trip() {
    let (out1, out2, w) = (tmp("y1.safetensors"), tmp("y2.safetensors"), tmp("w.safetensors"));
    let o =
        run(&[&FAST[..], &["--seed", "5", "--save-output", out1.to_str().unwrap(), "--save-weights", w.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    // Feed the saved x and weights back in (with a different --seed, which must not matter).
    let o = run(
        &[
            "--weights",
            w.to_str().unwrap(),
            "--input",
            out1.to_str().unwrap(),
            "--seed",
            "6",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--save-output",
            out2.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let a = candle_core::safetensors::load(&out1, &Device::Cpu).unwrap();
    let b = candle_core::safetensors::load(&out2, &Device::Cpu).unwrap();
    assert_eq!(a["x"].dims(), &[2, 64, 128]);
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(flat(&a["x"]), flat(&b["x"]));
    assert_eq!(flat(&a["y"]), flat(&b["y"]));
    assert_ne!(flat(&a["x"]), flat(&a["y"]));
    // An input of the wrong width is refused.
    let o = run(&["--input", out1.to_str().unwrap(), "--d-model", "64", "--heads", "4"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("C = 128 channels"), "{}", text(&o));
}

#[test]
fn flags_come_from_the_environment_too() {
    let path = tmp("env.json");
    let o = run(
        &[],
        &[
            ("SPEEDKIT_PRESET", "tiny"),
            ("SPEEDKIT_WARMUP", "0"),
            ("SPEEDKIT_ITERS", "3"),
            ("SPEEDKIT_SEQ", "16"),
            ("SPEEDKIT_NO_CHECK", "1"),
            ("SPEEDKIT_JSON", path.to_str().unwrap()),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("check     skipped"), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(j["shape"]["seq"], 16);
    assert_eq!(j["iters"], 3);
    assert!(j["check"].is_null());
    // A flag beats its variable.
    let o = run(&["--iters", "1", "--json", path.to_str().unwrap()], &[("SPEEDKIT_PRESET", "tiny"), ("SPEEDKIT_ITERS", "0")]);
    assert!(o.status.success(), "{}", text(&o));
}
