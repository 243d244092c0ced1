//! Issue 14 against the ladder: its own JSON read back as untrusted input (a property test on
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
    let mut c = Command::new(env!("CARGO_BIN_EXE_ladder"));
    c.current_dir(dir).args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SPEEDKIT_")) {
        c.env_remove(k);
    }
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
                let _ = r.table();
                let _ = ladder::render::markdown_table(&r);
                let _ = ladder::render::readme_region(&r, "a.json", "a.svg");
                let _ = ladder::chart::ladder_svg(&r);
            }
            Results::Sweep(s) => {
                let _ = ladder::render::sweep_text(&s);
                let _ = ladder::render::sweep_markdown(&s);
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
                // oversized: thousands of rows (a chart's width would overflow)
                let mut big = v.clone();
                if let Some(recs) = big.get("records").and_then(Value::as_array).cloned() {
                    big["records"] = Value::Array(recs.iter().cycle().take(5000).cloned().collect());
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
    let json = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results/ladder-cpu.json");
    let json = json.to_str().unwrap().to_string();
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
        prop_oneof![Just("fifo"), Just("."), Just(""), Just("x.svg"), Just("/dev/null")].prop_map(|p| vec![format!("--svg={p}")]),
        prop_oneof![Just("fifo"), Just("."), Just(""), Just("x.svg"), Just("/dev/stdout")].prop_map(|p| vec![format!("--json={p}")]),
        prop_oneof![Just("--markdown"), Just("--update-readme")].prop_map(|f| vec![f.to_string()]),
        prop_oneof![Just("nope.md"), Just("/dev/zero"), Just("")].prop_map(|p| vec![format!("--readme={p}")]),
    ];
    let sub = prop_oneof![Just(0u8), Just(1), Just(2)];
    let ran = std::cell::Cell::new(0u32);
    let config = ProptestConfig { cases: (cases() / 4).max(8), failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(which in sub, flags in prop::collection::vec(flag, 0..3), from in prop_oneof![Just(json.clone()), Just("/dev/zero".to_string()), Just("".to_string()), Just(".".to_string())])| {
        let mut args: Vec<String> = match which {
            0 => ["--preset", "tiny", "--iters", "1", "--warmup", "0", "--stages", "0"].iter().map(|s| s.to_string()).collect(),
            1 => vec!["render".into(), format!("--from={from}")],
            _ => vec!["report".into(), "--preset".into(), "tiny".into()],
        };
        args.extend(flags.into_iter().flatten());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = ladder_in(&d, &argv);
        ran.set(ran.get() + 1);
        prop_assert!(matches!(o.code, Some(0) | Some(2) | Some(3)), "exit {:?} for {:?}:\n{}", o.code, args, o.text);
        prop_assert!(!o.text.contains("panicked"), "panic for {:?}:\n{}", args, o.text);
    });
    eprintln!("ladder cli: {} generated cases ran", ran.get());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(d.join("fifo")).unwrap().file_type().is_fifo(), "an output replaced the FIFO");
}
