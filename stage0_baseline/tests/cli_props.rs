//! "Every bad input refused before any work, no panic anywhere", against the stage
//! binary: one regression test per class of bug found by a hostile-user pass, then a property
//! test over generated flag values and environment variables.
//!
//! Every run here uses the tiny preset with one iteration, so a case that is (rightly) accepted
//! finishes in well under a second.

use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speedkit-cli14-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Out {
    code: Option<i32>,
    text: String,
}

/// Run stage 0 with `args` in `dir`, with every SPEEDKIT_* variable cleared and `env` set.
fn stage0_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_stage0_baseline"));
    c.current_dir(dir).args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SPEEDKIT_")) {
        c.env_remove(k);
    }
    c.envs(env.iter().copied());
    let o = c.output().unwrap();
    Out { code: o.status.code(), text: format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)) }
}

const S: [&str; 6] = ["--preset", "tiny", "--iters", "1", "--warmup", "0"];

fn with_s<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    S.iter().copied().chain(extra.iter().copied()).collect()
}

/// Exit 2, no panic, and the message carries a fix.
fn refused(o: &Out) {
    assert_eq!(o.code, Some(2), "{}", o.text);
    assert!(!o.text.contains("panicked"), "{}", o.text);
    assert!(o.text.contains("Fix"), "{}", o.text);
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.contains(".tmp")).collect()
}

/// A safetensors file of f32 tensors, written by hand so a test can put NaN where it likes.
fn write_safetensors(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(name.to_string(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}));
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

// Class 1: an atomic write never replaces a device node, a FIFO or a symlink.
#[test]
fn class1_outputs_never_replace_devices_fifos_or_symlinks() {
    let d = scratch("c1");
    // A FIFO in a scratch folder, not /dev/full: run against the old code as root, this test
    // would otherwise replace the machine's /dev/full with a file (it did, once).
    let fifo = make_fifo(&d);
    refused(&stage0_in(&d, &with_s(&["--json", "fifo"]), &[]));
    refused(&stage0_in(&d, &with_s(&["--save-output", "fifo"]), &[]));
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo_like(), "the FIFO was replaced");
    let real = d.join("real.json");
    std::fs::write(&real, "old").unwrap();
    std::os::unix::fs::symlink(&real, d.join("link.json")).unwrap();
    let o = stage0_in(&d, &with_s(&["--json", "link.json"]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    assert!(std::fs::symlink_metadata(d.join("link.json")).unwrap().file_type().is_symlink(), "the link stays a link");
    assert!(std::fs::read_to_string(&real).unwrap().contains("\"stage\""), "its target got the JSON");
    assert!(temp_files(&d).is_empty());
}

trait Fifo {
    fn is_fifo_like(&self) -> bool;
}
impl Fifo for std::fs::FileType {
    fn is_fifo_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_fifo()
    }
}

/// A FIFO named "fifo" in `dir` (mkfifo(1), present wherever coreutils are).
fn make_fifo(dir: &Path) -> PathBuf {
    let p = dir.join("fifo");
    if !p.exists() {
        assert!(Command::new("mkfifo").arg(&p).status().unwrap().success());
    }
    p
}

// Class 2: counts that overflowed or allocated terabytes are refused with exit 2.
#[test]
fn class2_huge_counts_are_refused_not_panics() {
    let d = scratch("c2");
    for iters in ["18446744073709551615", "1000000000000"] {
        refused(&stage0_in(&d, &["--preset", "tiny", "--warmup", "0", "--iters", iters], &[]));
    }
    refused(&stage0_in(&d, &["--preset", "tiny", "--warmup", "18446744073709551615", "--iters", "1"], &[]));
}

// Class 3: the memory-fit / size check counts W_qkv and comes before any allocation (this
// returns at once; before the fix it allocated 12.9 GB first).
#[test]
fn class3_shape_checks_count_w_qkv_before_allocating() {
    let d = scratch("c3");
    let t0 = std::time::Instant::now();
    let o = stage0_in(&d, &with_s(&["--batch", "1", "--seq", "1", "--d-model", "32768", "--heads", "1", "--ff", "32768"]), &[]);
    refused(&o);
    let o2 = stage0_in(&d, &with_s(&["--d-model", "30000", "--heads", "1", "--ff", "1"]), &[]);
    refused(&o2);
    assert!(o2.text.contains("W_qkv"), "{}", o2.text);
    assert!(t0.elapsed().as_secs() < 60, "refused before allocating");
}

// Class 5: NaN or inf in a user's file is bad input (exit 2 naming file, tensor, first index).
#[test]
fn class5_non_finite_input_is_bad_input_named() {
    let d = scratch("c5");
    let mut v = vec![0.5f32; 2 * 64 * 128];
    v[128 * 3 + 5] = f32::INFINITY;
    write_safetensors(&d.join("inf.safetensors"), &[("x", vec![2, 64, 128], v)]);
    let o = stage0_in(&d, &with_s(&["--input", "inf.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("inf.safetensors") && o.text.contains("tensor x") && o.text.contains("[0, 3, 5]"), "{}", o.text);
    // A NaN in a weights file, named by its GPT-2 key.
    let o = stage0_in(&d, &with_s(&["--save-weights", "w.safetensors"]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    let bytes = std::fs::read(d.join("w.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["h.0.ln_2.bias"]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut bad = bytes.clone();
    bad[8 + n + start..8 + n + start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(d.join("nan.safetensors"), bad).unwrap();
    let o = stage0_in(&d, &with_s(&["--weights", "nan.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("h.0.ln_2.bias") && o.text.contains("[0]"), "{}", o.text);
}

// Class 6: two outputs on one path are refused before the run.
#[test]
fn class6_two_outputs_on_one_path_are_refused() {
    let d = scratch("c6");
    let o = stage0_in(&d, &with_s(&["--json", "same.out", "--save-output", "same.out"]), &[]);
    refused(&o);
    let o = stage0_in(&d, &with_s(&["--save-weights", "x.st", "--save-output", "./sub/../x.st"]), &[]);
    refused(&o);
    assert!(!d.join("same.out").exists() && !d.join("x.st").exists(), "nothing written");
}

// Class 7: a save onto a directory is exit 2 naming the path, and leaves no temp file.
#[test]
fn class7_save_to_a_directory_names_it_and_leaves_nothing() {
    let d = scratch("c7");
    std::fs::create_dir(d.join("adir")).unwrap();
    for flag in ["--save-output", "--json", "--save-weights"] {
        let o = stage0_in(&d, &with_s(&[flag, "adir"]), &[]);
        refused(&o);
        assert!(o.text.contains("adir") && o.text.contains("directory"), "{}", o.text);
    }
    assert!(temp_files(&d).is_empty() && temp_files(&d.join("adir")).is_empty());
}

// Class 8: an option combination that is refused is refused before any file is written.
#[test]
fn class8_refusals_come_before_any_output() {
    let d = scratch("c8");
    let o = stage0_in(&d, &with_s(&["--precision", "tf32", "--save-weights", "w.safetensors"]), &[]);
    refused(&o);
    assert!(!d.join("w.safetensors").exists(), "--save-weights was written before the refusal");
}

// Class 9: the smaller ones.
#[test]
fn class9_smaller_ones() {
    let d = scratch("c9");
    // --peak-tflops must be a sane device peak.
    for p in ["1e-300", "1e300", "0"] {
        refused(&stage0_in(&d, &with_s(&["--peak-tflops", p]), &[]));
    }
    // No backtrace in a user's message with RUST_BACKTRACE=1.
    std::fs::write(d.join("junk.safetensors"), b"\x10\0\0\0\0\0\0\0{\"x\":{\"dtype\":1}}").unwrap();
    let o = stage0_in(&d, &with_s(&["--input", "junk.safetensors"]), &[("RUST_BACKTRACE", "1")]);
    refused(&o);
    assert!(!o.text.contains("stack backtrace") && !o.text.contains(" 0: "), "{}", o.text);
    // Corrupt n_head metadata is refused, not ignored.
    let o = stage0_in(&d, &with_s(&["--save-weights", "w.safetensors"]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    let bytes = std::fs::read(d.join("w.safetensors")).unwrap();
    let text = String::from_utf8_lossy(&bytes[..200]).into_owned();
    assert!(text.contains("\"n_head\":\"4\""), "{text}");
    let bad = String::from_utf8_lossy(&bytes).replacen("\"n_head\":\"4\"", "\"n_head\":\"0\"", 1);
    let mut bad_bytes = bytes.clone();
    let at = text.find("\"n_head\":\"4\"").unwrap() + "\"n_head\":\"".len();
    bad_bytes[at] = b'0';
    assert!(bad.contains("\"n_head\":\"0\""));
    std::fs::write(d.join("bad_meta.safetensors"), bad_bytes).unwrap();
    let o = stage0_in(&d, &with_s(&["--weights", "bad_meta.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("n_head"), "{}", o.text);
    // B from the input file is named as such, not as --batch.
    write_safetensors(&d.join("x0.safetensors"), &[("x", vec![0, 64, 128], vec![])]);
    let o = stage0_in(&d, &with_s(&["--input", "x0.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("x0.safetensors") && !o.text.contains("--batch"), "{}", o.text);
    // --save-output gets the same mode as every other output (0666 less the umask).
    let o = stage0_in(&d, &with_s(&["--save-output", "y.safetensors", "--json", "r.json"]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    use std::os::unix::fs::MetadataExt;
    let mode = |p: &str| std::fs::metadata(d.join(p)).unwrap().mode() & 0o777;
    assert_eq!(mode("y.safetensors"), mode("r.json"));
}

/// Run stage 0 under `ulimit -v KIB` (a subprocess shell, so the limit binds only it).
fn stage0_ulimit(dir: &Path, kib: u64, args: &[&str]) -> Out {
    let mut c = Command::new("sh");
    c.current_dir(dir)
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_stage0_baseline"))
        .args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SPEEDKIT_")) {
        c.env_remove(k);
    }
    let o = c.output().unwrap();
    Out { code: o.status.code(), text: format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)) }
}

/// Nothing ran: the session never opened (its "timing" line is printed before any stage).
fn nothing_ran(o: &Out) {
    assert!(!o.text.contains("timing    ") && !o.text.contains("median"), "it ran before refusing:\n{}", o.text);
}

// under an address-space limit the shape that passed the fit check aborted
// in the ceiling probe; now the limit counts, the probe's buffers count, and it is exit 2.
#[test]
fn class_b_memory_limit_is_exit_2_never_an_abort() {
    let d = scratch("r3b");
    let big = [
        "--preset",
        "tiny",
        "--d-model",
        "12288",
        "--heads",
        "96",
        "--ff",
        "49152",
        "--batch",
        "1",
        "--seq",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
    ];
    let o = stage0_ulimit(&d, 8_000_000, &big);
    refused(&o);
    assert!(o.text.contains("available") && !o.text.contains("memory allocation"), "{}", o.text);
    // The session (2.4 GB of weights) fits in 3 GB but not beside the probe (fc1: x, W, y at
    // C = 4096, FF = 65536, 1 GiB more): refused up front, where it used to abort in the probe.
    let probe = [
        "--preset",
        "tiny",
        "--d-model",
        "4096",
        "--heads",
        "32",
        "--ff",
        "65536",
        "--batch",
        "1",
        "--seq",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--no-check",
    ];
    let o = stage0_ulimit(&d, 3_200_000, &probe);
    refused(&o);
    assert!(!o.text.contains("memory allocation"), "{}", o.text);
}

// an output that is an input is refused before the run; the input stays.
#[test]
fn class_c_output_onto_an_input_is_refused() {
    let d = scratch("r3c");
    write_safetensors(&d.join("x.safetensors"), &[("x", vec![1, 4, 128], vec![0.25; 512])]);
    let before = std::fs::read(d.join("x.safetensors")).unwrap();
    let o = stage0_in(&d, &with_s(&["--input", "x.safetensors", "--save-output", "./x.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("--input"), "{}", o.text);
    assert_eq!(std::fs::read(d.join("x.safetensors")).unwrap(), before);
}

// refused up front, the way the write happens, with the fix for the cause.
#[test]
fn class_e_unwritable_outputs_refused_before_the_run() {
    let d = scratch("r3e");
    // A /dev/fd/N (closed or not) and /proc are no files of their own.
    let mut cases = vec![("--json", "/dev/fd/99", "not a file of its own")];
    if Path::new("/proc/self").exists() {
        cases.push(("--json", "/proc/speedkit-x.json", "/proc"));
        cases.push(("--save-output", "/proc/speedkit-x.safetensors", "/proc"));
    }
    for (flag, path, why) in cases {
        let o = stage0_in(&d, &with_s(&[flag, path]), &[]);
        refused(&o);
        nothing_ran(&o);
        assert!(o.text.contains(why) && !o.text.contains("free space"), "{}", o.text);
    }
    // A legal 250-byte name: written, no temp file left.
    let long = "n".repeat(250);
    let o = stage0_in(&d, &with_s(&["--json", &long]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    assert!(d.join(&long).is_file() && temp_files(&d).is_empty());
    let o = stage0_in(&d, &with_s(&["--json", &"n".repeat(256)]), &[]);
    refused(&o);
    nothing_ran(&o);
}

// --bandwidth-gbs is bounded like --peak-tflops.
#[test]
fn class_g_bandwidth_is_bounded() {
    let d = scratch("r3g");
    for v in ["1e300", "1e-300", "5e-324", "-0", "inf"] {
        let o = stage0_in(&d, &with_s(&[&format!("--bandwidth-gbs={v}")]), &[]);
        refused(&o);
        assert!(o.text.contains("--bandwidth-gbs"), "{}", o.text);
    }
}

// No silent no-ops (stage 3's binary checks the same for `--fusions ""`).
#[test]
fn class_h_empty_values_and_folder_paths_are_refused() {
    let d = scratch("r3h");
    let o = stage0_in(&d, &with_s(&[]), &[("SPEEDKIT_PRECISION", "")]);
    refused(&o);
    assert!(o.text.contains("SPEEDKIT_PRECISION"), "{}", o.text);
    let o = stage0_in(&d, &with_s(&["--json", "newname/"]), &[]);
    refused(&o);
    nothing_ran(&o);
    assert!(!d.join("newname").exists());
}

// messages name what the user typed and what is wrong.
#[test]
fn class_i_messages_are_precise() {
    let d = scratch("r3i");
    let o = stage0_in(&d, &with_s(&["--heads", "256"]), &[]);
    refused(&o);
    assert!(o.text.contains("[64, 128]") && !o.text.contains("[]"), "{}", o.text);
    let o = stage0_in(&d, &with_s(&[]), &[("SPEEDKIT_JSON", "")]);
    refused(&o);
    assert!(o.text.contains("SPEEDKIT_JSON") && !o.text.contains("a value is required"), "{}", o.text);
    // A rank-1 attention weight is named.
    let o = stage0_in(&d, &with_s(&["--save-weights", "w.safetensors"]), &[]);
    assert_eq!(o.code, Some(0), "{}", o.text);
    let bytes = std::fs::read(d.join("w.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let key = "\"h.0.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":[128,384]";
    assert!(header.contains(key), "{header}");
    let flat = header.replace(key, &format!("{}{}", "\"h.0.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":[49152]", " ".repeat(4)));
    let mut bad = (flat.len() as u64).to_le_bytes().to_vec();
    bad.extend(flat.as_bytes());
    bad.extend(&bytes[8 + n..]);
    std::fs::write(d.join("rank1.safetensors"), bad).unwrap();
    let o = stage0_in(&d, &with_s(&["--weights", "rank1.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("attn.c_attn.weight") && o.text.contains("2 dimensions"), "{}", o.text);
    // A duplicated header key with its own data is refused naming the key, not blamed on NaN.
    let t = r#"{"dtype":"F32","shape":[1,1,128],"data_offsets":[0,512]}"#;
    let h = format!(r#"{{"x":{t},"x":{{"dtype":"F32","shape":[1,1,128],"data_offsets":[512,1024]}}}}"#);
    let mut dup = (h.len() as u64).to_le_bytes().to_vec();
    dup.extend(h.as_bytes());
    dup.extend(std::iter::repeat_n(0.5f32.to_le_bytes(), 128).flatten());
    dup.extend(std::iter::repeat_n(f32::NAN.to_le_bytes(), 128).flatten());
    std::fs::write(d.join("dup.safetensors"), dup).unwrap();
    let o = stage0_in(&d, &with_s(&["--input", "dup.safetensors"]), &[]);
    refused(&o);
    assert!(o.text.contains("dup.safetensors") && o.text.contains("\"x\" twice") && !o.text.contains("NaN"), "{}", o.text);
}

// a thread pool of 100,000 is refused at once, a sane one runs.
#[test]
fn class_j_rayon_threads_are_bounded() {
    let d = scratch("r3j");
    let t0 = std::time::Instant::now();
    let o = stage0_in(&d, &with_s(&[]), &[("RAYON_NUM_THREADS", "100000")]);
    refused(&o);
    assert!(o.text.contains("RAYON_NUM_THREADS") && t0.elapsed().as_secs() < 30, "{}", o.text);
    refused(&stage0_in(&d, &with_s(&[]), &[("RAYON_NUM_THREADS", "many")]));
    // Rayon parses the value untrimmed: " 1 " would pass a trimmed check and run one per core.
    refused(&stage0_in(&d, &with_s(&[]), &[("RAYON_NUM_THREADS", " 1 ")]));
    let o = stage0_in(&d, &with_s(&[]), &[("RAYON_NUM_THREADS", "2")]);
    assert_eq!(o.code, Some(0), "{}", o.text);
}

/// Values a hostile user might type for a count or a dimension.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("4294967296".to_string()),
        Just("2147483648".to_string()),
        Just("65536".to_string()),
        Just("-1".to_string()),
        Just("".to_string()),
        Just("1e3".to_string()),
        Just("nan".to_string()),
        Just(" 7".to_string()),
        (0usize..9).prop_map(|v| v.to_string()),
        (1usize..200).prop_map(|v| v.to_string()),
    ]
}

/// Numbers at the float limits, for --peak-tflops and --bandwidth-gbs.
fn float() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("1e300".to_string()),
        Just("1e-300".to_string()),
        Just("5e-324".to_string()),
        Just("1.7976931348623157e308".to_string()),
        Just("1e309".to_string()),
        Just("-0".to_string()),
        Just("-1e-3".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("NaN".to_string()),
        Just("20".to_string()),
        any::<f64>().prop_map(|v| format!("{v:e}")),
    ]
}

/// Paths and values: every kind of file the program might be pointed at (all inside the scratch
/// folder, made by `special_files`, or streams and places that refuse new files), and lengths
/// around NAME_MAX and far past it.
fn garbage() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("".to_string()),
        Just("garbage".to_string()),
        Just("fifo".to_string()),  // a FIFO in the scratch folder (never /dev/full: see class 1)
        Just("lfifo".to_string()), // a symlink to it
        Just("sock".to_string()),  // a UNIX socket
        Just("adir".to_string()),  // a directory
        Just("empty".to_string()), // an empty regular file
        Just("newname/".to_string()),
        Just("/dev/null".to_string()),
        Just("/dev/fd/99".to_string()), // closed in the child
        Just("/proc/speedkit-x.json".to_string()),
        Just(".".to_string()),
        Just("-".to_string()),
        Just("\u{feff}x".to_string()),
        Just("n".repeat(250)),
        Just("n".repeat(256)),
        Just("d/".repeat(2100) + "x.json"),
        Just("x".repeat(70_000)),
        "[a-z0-9/._-]{0,12}",
    ]
}

/// The special files `garbage` names, in `dir`.
fn special_files(dir: &Path) {
    make_fifo(dir);
    let _ = std::os::unix::fs::symlink("fifo", dir.join("lfifo"));
    let _ = std::os::unix::net::UnixListener::bind(dir.join("sock"));
    let _ = std::fs::create_dir(dir.join("adir"));
    std::fs::write(dir.join("empty"), b"").unwrap();
}

/// One generated case: flags with extreme values on top of the tiny preset (when it is not
/// overridden), and SPEEDKIT_* variables with garbage.
fn case() -> impl Strategy<Value = (Vec<String>, Vec<(String, String)>)> {
    let flag = prop_oneof![
        Just("--iters"),
        Just("--warmup"),
        Just("--batch"),
        Just("--seq"),
        Just("--d-model"),
        Just("--heads"),
        Just("--ff"),
        Just("--seed"),
        Just("--layer"),
    ];
    let path_flag = prop_oneof![
        Just("--json"),
        Just("--save-output"),
        Just("--save-weights"),
        Just("--weights"),
        Just("--input"),
        Just("--precision"),
        Just("--device"),
        Just("--fusions"),
    ];
    let float_flag = prop_oneof![Just("--peak-tflops"), Just("--bandwidth-gbs")];
    let env = prop_oneof![
        Just("SPEEDKIT_ITERS"),
        Just("SPEEDKIT_SEQ"),
        Just("SPEEDKIT_PRESET"),
        Just("SPEEDKIT_DEVICE"),
        Just("SPEEDKIT_PRECISION"),
        Just("SPEEDKIT_NO_CHECK"),
        Just("SPEEDKIT_PEAK_TFLOPS"),
        Just("SPEEDKIT_JSON"),
        Just("SPEEDKIT_FP8_RECIPE"),
        Just("SPEEDKIT_HEADS"),
        Just("SPEEDKIT_FUSIONS"),
        Just("SPEEDKIT_BANDWIDTH_GBS"),
        Just("SPEEDKIT_SAVE_OUTPUT"),
        Just("RAYON_NUM_THREADS"),
    ];
    (
        prop::collection::vec((flag, number()), 0..4),
        prop::collection::vec((float_flag, float()), 0..2),
        prop::collection::vec((path_flag, garbage()), 0..2),
        prop::collection::vec((env, prop_oneof![number(), garbage(), float()]), 0..3),
    )
        .prop_map(|(nums, floats, paths, envs)| {
            let mut args: Vec<String> = vec!["--preset".into(), "tiny".into()];
            if !nums.iter().any(|(f, _)| *f == "--iters") {
                args.extend(["--iters".into(), "1".into(), "--warmup".into(), "0".into()]);
            }
            for (f, v) in nums.into_iter().chain(floats).chain(paths) {
                // A count the bounds accept but that runs for minutes (65536 forwards of tiny) tests
                // nothing the refused extremes do not: such counts run as 200.
                let long = matches!(f, "--iters" | "--warmup") && v.trim().parse::<u64>().is_ok_and(|n| (201..=1_000_000).contains(&n));
                args.push(format!("{f}={}", if long { "200" } else { &v }));
            }
            (args, envs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
        })
}

/// How many generated cases run: SPEEDKIT_PROP_CASES, else 32 (under a minute on 2 busy cores).
fn cases() -> u32 {
    std::env::var("SPEEDKIT_PROP_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32)
}

#[test]
fn generated_flags_and_env_exit_0_2_or_3_and_never_panic() {
    let d = scratch("prop");
    let fifo = make_fifo(&d);
    special_files(&d);
    let ran = std::sync::atomic::AtomicU32::new(0);
    let config = ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |((args, envs) in case())| {
        // A value large enough to run for minutes is refused by the bounds (MAX_ITERS is 10^6):
        // iters up to 200 of tiny take well under a second each.
        let env: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = stage0_in(&d, &argv, &env);
        ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        prop_assert!(matches!(o.code, Some(0) | Some(2) | Some(3)), "exit {:?} for {:?} {:?}:\n{}", o.code, args, envs, o.text);
        prop_assert!(!o.text.contains("panicked"), "panic for {:?} {:?}:\n{}", args, envs, o.text);
        prop_assert!(!o.text.contains("memory allocation"), "abort for {:?} {:?}:\n{}", args, envs, o.text);
        prop_assert!(!o.text.contains("free space") || o.text.contains("No space left"), "fix text for another cause {:?}:\n{}", args, o.text);
    });
    eprintln!("cli_props: {} generated cases ran", ran.load(std::sync::atomic::Ordering::Relaxed));
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo_like(), "an output replaced the FIFO");
    assert!(d.join("adir").is_dir() && !d.join("newname").exists(), "an output replaced a folder or wrote 'newname/' as a file");
}
