//! The ladder's own JSON read back as untrusted input (a property test on
//! mutated, truncated and oversized files), a failed run that must not change recorded results,
//! and outputs checked before anything runs.

use ladder::{load, Results};
use proptest::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speedkit-rel14-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Out {
    code: Option<i32>,
    text: String,
}

fn ladder_in(dir: &Path, args: &[&str]) -> Out {
    ladder_env(dir, args, &[])
}

/// The ladder in `dir` with every SPEEDKIT_* variable cleared and `env` set, killed after 120 s
/// (`timeout`), so a regression that hangs (a FIFO read) fails instead of stalling CI.
fn ladder_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut c = Command::new("timeout");
    c.current_dir(dir).arg("120").arg(env!("CARGO_BIN_EXE_ladder")).args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SPEEDKIT_")) {
        c.env_remove(k);
    }
    c.envs(env.iter().copied());
    let o = c.output().unwrap();
    Out { code: o.status.code(), text: format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)) }
}

fn refused(o: &Out) {
    assert_eq!(o.code, Some(2), "{}", o.text);
    assert!(!o.text.contains("panicked") && o.text.contains("Fix"), "{}", o.text);
}

const S: [&str; 6] = ["--preset", "tiny", "--iters", "1", "--warmup", "0"];

fn with_s<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    S.iter().copied().chain(extra.iter().copied()).collect()
}

/// The committed CPU run: a real ladder JSON to mutate.
fn recorded() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results/ladder-cpu.json");
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

// Class 2: a JSON whose shape.n_head is 0 divided by zero in `ladder render`.
#[test]
fn class2_render_refuses_n_head_zero() {
    let d = scratch("c2");
    let mut v = recorded();
    v["shape"]["n_head"] = 0.into();
    std::fs::write(d.join("x.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    let o = ladder_in(&d, &["render", "--from", "x.json", "--svg", "z.svg"]);
    refused(&o);
    assert!(o.text.contains("x.json") && !d.join("z.svg").exists(), "{}", o.text);
}

// Class 4: a failed run (here: bad input) leaves the recorded JSON, chart and README alone.
#[test]
fn class4_failed_run_keeps_recorded_results() {
    let d = scratch("c4");
    std::fs::create_dir_all(d.join("results")).unwrap();
    let readme = "# t\n<!-- results:begin -->\nold table\n<!-- results:end -->\n";
    std::fs::write(d.join("README.md"), readme).unwrap();
    std::fs::write(d.join("results/ladder-cpu.json"), "{\"old\": 1}").unwrap();
    // x with a NaN: refused as bad input before any stage runs.
    let mut header =
        serde_json::to_vec(&serde_json::json!({"x": {"dtype": "F32", "shape": [1, 1, 128], "data_offsets": [0, 512]}})).unwrap();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend(std::iter::repeat_n(f32::NAN.to_le_bytes(), 128).flatten());
    std::fs::write(d.join("nan.safetensors"), bytes).unwrap();
    let o = ladder_in(&d, &with_s(&["--stages", "0,1", "--input", "nan.safetensors", "--update-readme"]));
    refused(&o);
    assert_eq!(std::fs::read_to_string(d.join("results/ladder-cpu.json")).unwrap(), "{\"old\": 1}");
    assert_eq!(std::fs::read_to_string(d.join("README.md")).unwrap(), readme);
    assert!(!d.join("results/ladder-cpu.svg").exists());
}

// Class 6: --json and --svg on one path are refused before the run.
#[test]
fn class6_json_and_svg_on_one_path() {
    let d = scratch("c6");
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--json", "same.out", "--svg", "same.out"]));
    refused(&o);
    assert!(!d.join("same.out").exists() && !o.text.contains("ran "), "{}", o.text);
}

// Class 8: --update-readme with --svg outside the README's folder is refused before any stage
// runs, and nothing is written.
#[test]
fn class8_update_readme_link_checked_before_running() {
    let d = scratch("c8");
    std::fs::create_dir_all(d.join("repo")).unwrap();
    std::fs::write(d.join("repo/README.md"), "<!-- results:begin -->\n<!-- results:end -->\n").unwrap();
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--update-readme", "--readme", "repo/README.md", "--svg", "outside.svg"]));
    refused(&o);
    assert!(!o.text.contains("ran "), "a stage ran before the refusal:\n{}", o.text);
    assert!(!d.join("outside.svg").exists() && !d.join("repo/results").exists());
}

// A --readme or --from that is not a regular file (/dev/zero never ends; /dev/stdout, a pipe
// here, waits for ever; a FIFO waits for a writer) is refused (exit 2) before any stage runs,
// instead of filling memory or hanging.
#[test]
fn device_or_pipe_readme_or_from_is_refused() {
    let d = scratch("endless");
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--update-readme", "--readme=/dev/zero"]));
    refused(&o);
    assert!(o.text.contains("/dev/zero") && !o.text.contains("ran "), "{}", o.text);
    refused(&ladder_in(&d, &["render", "--from=/dev/zero"]));
    refused(&ladder_in(&d, &["render", "--from=/dev/stdout"]));
    // A FIFO with no writer: refused before it is opened (opening it would wait for a writer).
    assert!(Command::new("mkfifo").arg(d.join("fifo.json")).status().unwrap().success());
    refused(&ladder_in(&d, &["render", "--from=fifo.json"]));
}

// Class 9: `ladder report` does not silently ignore output flags; --peak-tflops is bounded;
// a sweep value whose 4·C overflows is a skipped row, not a wrapped shape.
#[test]
fn class9_report_flags_peak_and_sweep_overflow() {
    let d = scratch("c9");
    for flag in ["--json", "--save-output"] {
        let o = ladder_in(&d, &["report", "--preset", "tiny", flag, "r.out"]);
        refused(&o);
        assert!(o.text.contains(flag), "{}", o.text);
    }
    refused(&ladder_in(&d, &with_s(&["--stages", "0", "--peak-tflops", "1e-300"])));
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--sweep", "d_model=4611686018427387904"]));
    assert!(o.code == Some(0) && o.text.contains("overflows") && !o.text.contains("panicked"), "{}", o.text);
}

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_vec(v).unwrap()).unwrap();
}

// a 70,000-character stage name panicked in the table's padding; every
// string read from the file is bounded.
#[test]
fn class_a_long_strings_in_render_are_refused() {
    let d = scratch("r3a");
    for field in [&["records", "0", "stage"][..], &["skipped"], &["versions"]] {
        let mut v = recorded();
        match field {
            ["skipped"] => {
                v["skipped"] = serde_json::json!([{"stage": "s".repeat(70_000), "technique": "t", "reason": "r", "failed": false}])
            }
            ["versions"] => v["versions"] = serde_json::json!({"k".repeat(70_000): "1"}),
            path => set(&mut v, &path.iter().map(|s| s.to_string()).collect::<Vec<_>>(), Value::from("x".repeat(70_000))),
        }
        write_json(&d.join("long.json"), &v);
        let o = ladder_in(&d, &["render", "--from", "long.json", "--markdown"]);
        refused(&o);
        assert!(o.text.contains("characters long"), "{}", o.text);
    }
}

// `ladder report` checks the probe's fit before probing; a failed
// allocation is exit 2 with the memory message, never an abort.
#[test]
fn class_b_report_fit_checks_before_probing() {
    let d = scratch("r3b");
    let o = Command::new("sh")
        .current_dir(&d)
        .arg("-c")
        .arg("ulimit -v 4000000 && exec \"$0\" report --preset tiny --d-model 26000 --heads 1000 --ff 80000 --batch 1 --seq 1")
        .arg(env!("CARGO_BIN_EXE_ladder"))
        .output()
        .unwrap();
    let o = Out { code: o.status.code(), text: format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)) };
    refused(&o);
    assert!(o.text.contains("ceiling probe") && o.text.contains("memory") && !o.text.contains("memory allocation"), "{}", o.text);
}

// a JSON named like a sibling chart is an input, never overwritten.
#[test]
fn class_c_outputs_never_overwrite_the_from_file() {
    let d = scratch("r3c");
    let json = serde_json::to_vec(&recorded()).unwrap();
    std::fs::write(d.join("run-roofline.svg"), &json).unwrap();
    let o = ladder_in(&d, &["render", "--from", "run-roofline.svg", "--svg", "run.svg"]);
    refused(&o);
    assert!(o.text.contains("--from"), "{}", o.text);
    assert_eq!(std::fs::read(d.join("run-roofline.svg")).unwrap(), json, "the input was overwritten");
    assert!(!d.join("run.svg").exists(), "written before the refusal");
}

// selftest's --json is checked before it runs; a refused --json gets a fix
// that names --json, not --svg.
#[test]
fn class_e_selftest_json_and_fix_text() {
    let d = scratch("r3e");
    std::fs::create_dir(d.join("adir")).unwrap();
    for bad in ["adir", "/dev/fd/99", "newname/"] {
        let o = ladder_in(&d, &["selftest", "--device", "cpu", "--json", bad]);
        refused(&o);
        assert!(
            o.text.contains("--json") && !o.text.contains("pass") && !o.text.contains("free space"),
            "ran before refusing:\n{}",
            o.text
        );
    }
    std::fs::create_dir_all(d.join("repo")).unwrap();
    std::fs::write(d.join("repo/README.md"), "<!-- results:begin -->\n<!-- results:end -->\n").unwrap();
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--update-readme", "--readme", "repo/README.md", "--json", "out.json"]));
    refused(&o);
    assert!(o.text.contains("--json out.json") && !o.text.contains("drop --svg"), "{}", o.text);
}

// numbers outside the per-stage records are bounded too, with row and part limits.
#[test]
fn class_f_render_bounds_every_number_and_count() {
    let d = scratch("r3f");
    let base = recorded();
    let bad_part = "1".repeat(300);
    type Edit = Box<dyn Fn(&mut Value)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("ceiling", Box::new(|v: &mut Value| v["ceiling"]["gemm_gflops"] = Value::from(-1.0))),
        ("ceilings", Box::new(|v: &mut Value| v["ceilings"]["tflops"]["fp32"] = Value::from(-3.0))),
        ("ceilings", Box::new(|v: &mut Value| v["ceilings"]["bandwidth_gbs"] = Value::from(1e300))),
        ("breakdown", Box::new(|v: &mut Value| v["records"][0]["breakdown"]["parts"][0]["median_ms"] = Value::from(-2.0))),
        (
            "breakdown",
            Box::new(move |v: &mut Value| v["records"][0]["breakdown"]["parts"][0]["median_ms"] = serde_json::from_str(&bad_part).unwrap()),
        ),
        ("ablation", Box::new(|v: &mut Value| v["ablation"][0]["record"]["timing"]["median_ms"] = Value::from(-5.0))),
        ("ablation", Box::new(|v: &mut Value| v["ablation"][0]["buys"] = Value::from(-1.0))),
        (
            "parts",
            Box::new(|v: &mut Value| {
                let p = v["records"][0]["breakdown"]["parts"][0].clone();
                v["records"][0]["breakdown"]["parts"] = Value::Array(vec![p; 5000]);
            }),
        ),
        (
            "ablation rows",
            Box::new(|v: &mut Value| {
                let a = v["ablation"][0].clone();
                v["ablation"] = Value::Array(vec![a; 5000]);
            }),
        ),
    ];
    for (what, edit) in edits {
        let mut v = base.clone();
        edit(&mut v);
        write_json(&d.join("f.json"), &v);
        let o = ladder_in(&d, &["render", "--from", "f.json", "--svg", "f.svg"]);
        refused(&o);
        assert!(!d.join("f.svg").exists(), "{what}: drawn before the refusal\n{}", o.text);
    }
}

// A part's regime in a file read back is computed again from its own time, shape and the run's
// ceilings: the README's prose cites these fields beside a table computed from the same record,
// so an edited field cannot make the two disagree.
#[test]
fn edited_regimes_are_recomputed_on_render() {
    let d = scratch("r3r");
    let render = |v: &Value| {
        write_json(&d.join("g.json"), v);
        let o = ladder_in(&d, &["render", "--from", "g.json", "--markdown"]);
        assert_eq!(o.code, Some(0), "{}", o.text);
        o.text
    };
    let want = render(&recorded());
    let mut v = recorded();
    let part = &mut v["records"][0]["breakdown"]["parts"][1]["regime"];
    part["pct_of_memory_roof"] = Value::from(50.0);
    part["regime"] = Value::from("memory-bound");
    assert_eq!(render(&v), want);
}

// --ablate with nothing to undo is refused, not silently empty.
#[test]
fn class_h_ablate_with_nothing_to_undo() {
    let d = scratch("r3h");
    for extra in [
        &["--stages", "0", "--elementwise", "candle"][..], // the engine's passes are the only thing stage 0 undoes
        &["--stages", "3", "--fusions", "none"],
        &["--stages", "4", "--fp8-recipe", "current"], // current scaling runs no FP8 fusion
        &["--stages", "4", "--fp8-fusions", "none"],
    ] {
        let mut args = with_s(&["--ablate"]);
        args.extend_from_slice(extra);
        let o = ladder_in(&d, &args);
        refused(&o);
        assert!(o.text.contains("--ablate") && !o.text.contains("ran "), "{}", o.text);
    }
    let o = ladder_env(&d, &with_s(&["--stages", "3"]), &[("SPEEDKIT_FUSIONS", "")]);
    refused(&o);
    assert!(o.text.contains("SPEEDKIT_FUSIONS"), "{}", o.text);
}

/// Replacement leaves: extremes a damaged or hand-edited file might hold.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::from(0)),
        Just(Value::from(-1)),
        Just(Value::from(u64::MAX)),
        Just(Value::from(1e308)),
        Just(Value::from(-1e308)),
        Just(Value::from(1e-300)),
        Just(Value::Null),
        Just(Value::from("")),
        Just(Value::from("candle-speedkit/ladder/v1")),
        Just(Value::Array(vec![])),
        any::<i64>().prop_map(Value::from),
        // numbers at the float limits, and strings far past any a run writes
        Just(Value::from(f64::MAX)),
        Just(Value::from(f64::MIN_POSITIVE)),
        Just(Value::from(5e-324)),
        Just(Value::from(-0.0)),
        Just(serde_json::from_str::<Value>(&"9".repeat(300)).unwrap()),
        any::<f64>().prop_map(Value::from),
        Just(Value::from("x".repeat(70_000))),
        Just(Value::from("é".repeat(5000))),
        (0usize..5000).prop_map(|n| Value::from("s".repeat(n))),
    ]
}

fn leaves(v: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => m.iter().for_each(|(k, x)| {
            path.push(k.clone());
            leaves(x, path, out);
            path.pop();
        }),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| {
            path.push(i.to_string());
            leaves(x, path, out);
            path.pop();
        }),
        _ => out.push(path.clone()),
    }
}

fn set(v: &mut Value, path: &[String], new: Value) {
    let mut cur = v;
    for k in path {
        cur = match cur {
            Value::Object(m) => m.get_mut(k).unwrap(),
            Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
            _ => unreachable!(),
        };
    }
    *cur = new;
}

/// What a mutated file does: load, and when it loads, every renderer on it. A panic fails the
/// test; an `Err` (exit 2 in the binary) is the right answer for a damaged file.
fn render_all(path: &Path) {
    if let Ok(results) = load(path) {
        match results {
            Results::Ladder(r) => {
                let _ = r.table(false);
                let _ = r.table(true);
                let _ = ladder::render::readme_region(&r, "a.json", "a.svg");
                let _ = ladder::chart::ladder_svg(&r);
                let _ = ladder::chart::breakdown_svg(&r);
                let _ = ladder::roofline::roofline_svg(&r);
                let _ = ladder::render::ablation_table(&r, false);
                let _ = ladder::render::ablation_table(&r, true);
                let _ = ladder::render::breakdown_table(&r, false);
                let _ = ladder::render::breakdown_table(&r, true);
            }
            Results::Sweep(s) => {
                let _ = ladder::render::sweep_tables(&s, false);
                let _ = ladder::render::sweep_tables(&s, true);
                let _ = ladder::chart::sweep_svg(&s);
            }
        }
    }
}

fn cases() -> u32 {
    std::env::var("SPEEDKIT_PROP_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
}

#[test]
fn mutated_truncated_and_oversized_json_never_panics() {
    let d = scratch("fuzz");
    let base = recorded();
    let mut paths = Vec::new();
    leaves(&base, &mut Vec::new(), &mut paths);
    let n_paths = paths.len();
    let path = d.join("m.json");
    let ran = std::cell::Cell::new(0u32);
    let config = ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(edits in prop::collection::vec((0..n_paths, leaf()), 1..6), cut in any::<prop::sample::Index>(), mode in 0u8..4)| {
        let mut v = base.clone();
        for (i, new) in edits {
            set(&mut v, &paths[i], new);
        }
        let mut bytes = serde_json::to_vec(&v).unwrap();
        match mode {
            0 => {} // mutated leaves only
            1 => bytes.truncate(cut.index(bytes.len())), // truncated
            2 => {
                // oversized: thousands of rows, ablation rows, breakdown parts or roofs (a
                // chart's width would overflow)
                let mut big = v.clone();
                let grow = |a: Option<&Value>| a.and_then(Value::as_array).filter(|a| !a.is_empty()).map(|a| Value::Array(a.iter().cycle().take(5000).cloned().collect()));
                match cut.index(4) {
                    0 => if let Some(g) = grow(big.get("records")) { big["records"] = g },
                    1 => if let Some(g) = grow(big.get("ablation")) { big["ablation"] = g },
                    2 => if let Some(g) = grow(big.pointer("/records/0/breakdown/parts")) { big["records"][0]["breakdown"]["parts"] = g },
                    _ => if let Some(m) = big.pointer_mut("/ceilings/tflops").and_then(Value::as_object_mut) {
                        for i in 0..5000 { m.insert(format!("p{i}"), Value::from(1.0)); }
                    },
                }
                bytes = serde_json::to_vec(&big).unwrap();
            }
            _ => {
                // a sweep wrapping the mutated run, with mismatched values
                let sweep = serde_json::json!({"schema": "candle-speedkit/sweep/v1", "axis": "seq", "values": [0, 1, u64::MAX], "runs": [v]});
                bytes = serde_json::to_vec(&sweep).unwrap();
            }
        }
        std::fs::write(&path, &bytes).unwrap();
        render_all(&path);
        ran.set(ran.get() + 1);
    });
    // Random bytes and an unparseable header.
    for bytes in [vec![], vec![0xff; 64], b"{\"schema\": \"candle-speedkit/ladder/v1\"".to_vec(), vec![b'['; 100_000]] {
        std::fs::write(&path, &bytes).unwrap();
        assert!(load(&path).is_err());
        ran.set(ran.get() + 1);
    }
    eprintln!("reliability: {} generated JSON files read", ran.get());
}

/// Ladder-only flags with hostile values: --stages, --sweep, the render/report subcommands and
/// their paths. Each case exits 0, 2 or 3 and never panics.
#[test]
fn generated_ladder_flags_exit_0_2_or_3_and_never_panic() {
    let d = scratch("cli");
    // Outputs aimed at a FIFO in the scratch folder, never at /dev/full: against buggy code run
    // as root, that would replace the machine's device node.
    assert!(Command::new("mkfifo").arg(d.join("fifo")).status().unwrap().success());
    // Every kind of file a path might name: a symlink to the FIFO, a socket, a folder, a JSON
    // named like a sibling chart. (Inputs are never FIFOs: reading one waits for a writer.)
    std::os::unix::fs::symlink("fifo", d.join("lfifo")).unwrap();
    let _ = std::os::unix::net::UnixListener::bind(d.join("sock"));
    std::fs::create_dir(d.join("adir")).unwrap();
    std::fs::write(d.join("README.md"), "<!-- results:begin -->\n<!-- results:end -->\n").unwrap();
    let recorded_bytes = serde_json::to_vec(&recorded()).unwrap();
    std::fs::write(d.join("x-roofline.svg"), &recorded_bytes).unwrap();
    let json = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results/ladder-cpu.json");
    let json = json.to_str().unwrap().to_string();
    let path = prop_oneof![
        Just("fifo".to_string()),
        Just("lfifo".to_string()),
        Just("sock".to_string()),
        Just("adir".to_string()),
        Just(".".to_string()),
        Just("".to_string()),
        Just("x.svg".to_string()),
        Just("x-roofline.svg".to_string()),
        Just("newname/".to_string()),
        Just("/dev/null".to_string()),
        Just("/dev/stdout".to_string()),
        Just("/dev/fd/99".to_string()),
        Just("/proc/speedkit-x.svg".to_string()),
        Just("n".repeat(250)),
        Just("n".repeat(256)),
        Just("x".repeat(70_000)),
    ];
    let float = prop_oneof![Just("1e300"), Just("1e-300"), Just("5e-324"), Just("-0"), Just("inf"), Just("NaN"), Just("20")];
    let value = prop_oneof![
        Just("0".to_string()),
        Just("".to_string()),
        Just("18446744073709551615".to_string()),
        Just("4611686018427387904".to_string()),
        Just("-1".to_string()),
        (1usize..40).prop_map(|v| v.to_string()),
    ];
    let flag = prop_oneof![
        value.clone().prop_map(|v| vec![format!("--stages={v}")]),
        value.clone().prop_map(|v| vec![format!("--stages=0,{v}")]),
        (prop_oneof![Just("seq"), Just("batch"), Just("d_model"), Just("heads"), Just("")], value.clone())
            .prop_map(|(a, v)| vec![format!("--sweep={a}={v}")]),
        path.clone().prop_map(|p| vec![format!("--svg={p}")]),
        path.clone().prop_map(|p| vec![format!("--json={p}")]),
        prop_oneof![Just("--markdown"), Just("--update-readme"), Just("--ablate")].prop_map(|f| vec![f.to_string()]),
        prop_oneof![Just("nope.md"), Just("/dev/zero"), Just(""), Just("adir"), Just("README.md")]
            .prop_map(|p| vec![format!("--readme={p}")]),
        (prop_oneof![Just("--bandwidth-gbs"), Just("--peak-tflops")], float).prop_map(|(f, v)| vec![format!("{f}={v}")]),
        prop_oneof![Just(""), Just("none"), Just("ln"), Just("all")].prop_map(|v| vec![format!("--fusions={v}")]),
    ];
    let env = prop_oneof![
        Just(("SPEEDKIT_JSON", "")),
        Just(("SPEEDKIT_FUSIONS", "")),
        Just(("SPEEDKIT_SVG", "")),
        Just(("SPEEDKIT_README", "adir")),
        Just(("RAYON_NUM_THREADS", "100000")),
        Just(("RAYON_NUM_THREADS", "abc")),
        Just(("RAYON_NUM_THREADS", "1")),
    ];
    let sub = prop_oneof![Just(0u8), Just(1), Just(2)];
    let ran = std::cell::Cell::new(0u32);
    let config = ProptestConfig { cases: (cases() / 4).max(8), failure_persistence: None, ..ProptestConfig::default() };
    let not_fifo = |p: &String| !p.contains("fifo");
    let from = prop_oneof![
        Just(json.clone()),
        Just(json.clone()),
        Just("/dev/zero".to_string()),
        path.clone().prop_filter("a FIFO waits", not_fifo)
    ];
    proptest!(config, |(which in sub, flags in prop::collection::vec(flag, 0..3), from in from, envs in prop::collection::vec(env.clone(), 0..2))| {
        let mut args: Vec<String> = match which {
            0 => ["--preset", "tiny", "--iters", "1", "--warmup", "0", "--stages", "0"].iter().map(|s| s.to_string()).collect(),
            1 => vec!["render".into(), format!("--from={from}")],
            _ => vec!["report".into(), "--preset".into(), "tiny".into()],
        };
        args.extend(flags.into_iter().flatten());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        // A ladder run may rightly write x-roofline.svg (--svg names it); render must never
        // overwrite it when it is the --from file. Restored before every case.
        std::fs::write(d.join("x-roofline.svg"), &recorded_bytes).unwrap();
        let o = ladder_env(&d, &argv, &envs);
        ran.set(ran.get() + 1);
        if which == 1 && from == "x-roofline.svg" {
            prop_assert!(std::fs::read(d.join("x-roofline.svg")).unwrap() == recorded_bytes, "the --from file was overwritten by {:?}:\n{}", args, o.text);
        }
        prop_assert!(matches!(o.code, Some(0) | Some(2) | Some(3)), "exit {:?} for {:?} {:?}:\n{}", o.code, args, envs, o.text);
        prop_assert!(!o.text.contains("panicked"), "panic for {:?} {:?}:\n{}", args, envs, o.text);
        prop_assert!(!o.text.contains("memory allocation"), "abort for {:?}:\n{}", args, o.text);
    });
    eprintln!("ladder cli: {} generated cases ran", ran.get());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(d.join("fifo")).unwrap().file_type().is_fifo(), "an output replaced the FIFO");
    assert!(d.join("adir").is_dir() && !d.join("newname").exists());
}

/// The ladder in `dir` as `ladder_env`, its stdout redirected to the file `stdout` (as `> f` does).
fn ladder_to_file(dir: &Path, args: &[&str], stdout: &Path) -> Out {
    let mut c = Command::new("timeout");
    c.current_dir(dir).arg("120").arg(env!("CARGO_BIN_EXE_ladder")).args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SPEEDKIT_")) {
        c.env_remove(k);
    }
    c.stdout(std::fs::File::create(stdout).unwrap());
    let o = c.output().unwrap();
    Out { code: o.status.code(), text: String::from_utf8_lossy(&o.stderr).into_owned() }
}

// `--svg /dev/stdout > f` replaced f with the chart (and, as root, made /dev/stdout-roofline.svg);
// `--json -` wrote a file named '-'. Every output flag refuses streams up front; nothing is written.
#[test]
fn streams_and_dash_are_refused_for_every_output_flag() {
    let d = scratch("streams");
    let f = d.join("f");
    let streams = ["/dev/stdout", "/dev/stderr", "/dev/fd/1", "/proc/self/fd/1"];
    for flag in ["--svg", "--json", "--save-weights", "--save-output"] {
        for path in streams.iter().copied().chain(["-"]) {
            let o = ladder_to_file(&d, &with_s(&["--stages", "0", flag, path]), &f);
            refused(&o);
            assert!(o.text.contains(&format!("{flag} {path}")) && o.text.contains("cat it"), "{}", o.text);
            // Refused before any work: the table never printed, so the redirect target is still empty.
            assert_eq!(std::fs::read(&f).unwrap(), b"", "{flag} {path} wrote into the redirected stdout");
        }
    }
    for path in ["/dev/stdout", "-"] {
        let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results/ladder-cpu.json");
        let o = ladder_to_file(&d, &["render", "--from", from.to_str().unwrap(), "--svg", path], &f);
        refused(&o);
        assert_eq!(std::fs::read(&f).unwrap(), b"");
    }
    // --update-readme's targets: --readme itself.
    let o = ladder_to_file(&d, &with_s(&["--stages", "0", "--update-readme", "--readme", "/dev/stdout"]), &f);
    refused(&o);
    let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["f"], "a refused run left files behind");
    assert!(!Path::new("/dev/stdout-roofline.svg").exists() && !Path::new("/dev/stdout-breakdown.svg").exists());
}

// SPEEDKIT_CPU_BF16 set to garbage, empty or an unknown case meant auto without a word.
#[test]
fn cpu_bf16_unknown_values_are_refused_before_work() {
    let d = scratch("cpubf16");
    for bad in ["garbage", "", "of", "amx"] {
        let o = ladder_env(&d, &with_s(&["--stages", "0", "--json", "x.json"]), &[("SPEEDKIT_CPU_BF16", bad)]);
        refused(&o);
        assert!(o.text.contains("SPEEDKIT_CPU_BF16") && o.text.contains(&format!("{bad:?}")), "{}", o.text);
        assert!(o.text.contains("auto, off, f32, avx512-bf16, mkl") && !o.text.contains("ran "), "{}", o.text);
        assert!(!d.join("x.json").exists());
    }
    for sub in [&["report", "--preset", "tiny"][..], &["selftest", "--device", "cpu", "--json", "s.json"]] {
        let o = ladder_env(&d, sub, &[("SPEEDKIT_CPU_BF16", "garbage")]);
        refused(&o);
        assert!(o.text.contains("SPEEDKIT_CPU_BF16") && !d.join("s.json").exists(), "{sub:?}: {}", o.text);
    }
    // Case does not matter: OFF is off (the run goes ahead).
    let o = ladder_env(&d, &with_s(&["--stages", "0"]), &[("SPEEDKIT_CPU_BF16", "OFF")]);
    assert_eq!(o.code, Some(0), "{}", o.text);
}

/// A README in `d` with `regions`, each on its own page (`render::region_page`: results-train on
/// docs/training.md); the README's text.
fn readme_with(d: &Path, regions: &[&str]) -> String {
    let mut pages: Vec<(std::path::PathBuf, String)> = Vec::new();
    for r in regions {
        let page = ladder::render::region_page(&d.join("README.md"), r).0;
        let text = format!("## {r}\n<!-- {r}:begin -->\nold {r}\n<!-- {r}:end -->\n");
        match pages.iter_mut().find(|(p, _)| *p == page) {
            Some((_, t)) => t.push_str(&text),
            None => pages.push((page, text)),
        }
    }
    for (page, text) in &pages {
        std::fs::create_dir_all(page.parent().unwrap()).unwrap();
        std::fs::write(page, text).unwrap();
    }
    pages.into_iter().find(|(p, _)| p.ends_with("README.md")).map(|(_, t)| t).unwrap_or_default()
}

fn files_under(d: &Path) -> Vec<String> {
    let mut all: Vec<String> =
        std::fs::read_dir(d).map_or(vec![], |r| r.map(|e| e.unwrap().file_name().to_string_lossy().into()).collect());
    all.sort();
    all
}

// `ladder --train --update-readme --readme-region results-train` wrote results/ladder-cpu.json and its
// charts: the forward region's files. A training run's defaults are results/ladder-cpu-train.*.
#[test]
fn training_run_writes_its_own_default_files() {
    let d = scratch("trainpaths");
    readme_with(&d, &["results", "results-train"]);
    let o = ladder_in(&d, &with_s(&["--stages", "0", "--train", "--update-readme", "--readme-region", "results-train"]));
    assert_eq!(o.code, Some(0), "{}", o.text);
    let want = ["ladder-cpu-train-roofline.svg", "ladder-cpu-train.json", "ladder-cpu-train.svg"];
    assert_eq!(files_under(&d.join("results")), want, "{}", o.text);
    let readme = std::fs::read_to_string(d.join("README.md")).unwrap();
    assert!(readme.contains("old results\n") && !readme.contains("results-train"), "{readme}");
    let page = std::fs::read_to_string(d.join("docs/training.md")).unwrap();
    assert!(!page.contains("old results-train"), "{page}");
    assert!(page.contains("(../results/ladder-cpu-train.json)") && page.contains("forward + backward ms"), "{page}");
}

// A training run or JSON into a forward region, or a forward one into the training region, is
// refused before any work: the README and the results files are as they were.
#[test]
fn regions_refuse_the_other_mode() {
    let d = scratch("regionmode");
    let readme = readme_with(&d, &["results", "results-gpu", "results-train"]);
    let training = std::fs::read_to_string(d.join("docs/training.md")).unwrap();
    std::fs::create_dir_all(d.join("results")).unwrap();
    let recorded = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    for f in ["ladder-cpu.json", "ladder-cpu-train.json"] {
        std::fs::copy(recorded.join(f), d.join("results").join(f)).unwrap();
    }
    let before = files_under(&d.join("results"));
    let runs: [(&[&str], &str); 4] = [
        (&["--train", "--update-readme"], "this run times training steps"),
        (&["--train", "--update-readme", "--readme-region", "results-gpu"], "this run times training steps"),
        (&["--update-readme", "--readme-region", "results-train"], "this run times forwards"),
        (&["--train", "--update-readme", "--readme-region", "results", "--json", "results/t.json"], "results-train"),
    ];
    for (flags, says) in runs {
        let mut args = with_s(&["--stages", "0"]);
        args.extend(flags);
        let o = ladder_in(&d, &args);
        refused(&o);
        assert!(o.text.contains(says) && !o.text.contains("ran "), "{flags:?}: {}", o.text);
    }
    let renders = [
        ("results/ladder-cpu-train.json", "results", "times training steps"),
        ("results/ladder-cpu-train.json", "results-gpu", "times training steps"),
        ("results/ladder-cpu.json", "results-train", "times forwards"),
    ];
    for (from, region, says) in renders {
        let o = ladder_in(&d, &["render", "--from", from, "--update-readme", "--readme-region", region]);
        refused(&o);
        assert!(o.text.contains(from) && o.text.contains(says) && o.text.contains(region), "{}", o.text);
    }
    assert_eq!(std::fs::read_to_string(d.join("README.md")).unwrap(), readme);
    assert_eq!(std::fs::read_to_string(d.join("docs/training.md")).unwrap(), training);
    assert_eq!(files_under(&d.join("results")), before);
    // Each into its own region: accepted, and the training one keeps to its own chart files.
    let o = ladder_in(&d, &["render", "--from", "results/ladder-cpu-train.json", "--update-readme", "--readme-region", "results-train"]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    assert!(d.join("results/ladder-cpu-train.svg").exists() && !d.join("results/ladder-cpu.svg").exists());
}

// A file whose records mix forward and training rows cannot be labelled: refused, nothing written.
#[test]
fn render_refuses_mixed_modes() {
    let d = scratch("mixedmode");
    let mut v = recorded();
    v["records"][1]["mode"] = "train".into();
    std::fs::write(d.join("x.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    for extra in [&[][..], &["--markdown"], &["--svg", "z.svg"]] {
        let mut args = vec!["render", "--from", "x.json"];
        args.extend(extra);
        let o = ladder_in(&d, &args);
        refused(&o);
        assert!(o.text.contains("mix forward and training"), "{}", o.text);
    }
    assert_eq!(files_under(&d), ["x.json"]);
}
