//! Unit tests of `shared/src/output.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("speedkit-out-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// tempfile's names start with ".tmp".
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect()
}

#[test]
fn replaces_a_regular_file_whole_and_keeps_no_temp() {
    let d = scratch("reg");
    let p = d.join("a.json");
    write("--json", &p, b"first, long content").unwrap();
    write("--json", &p, b"2nd").unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"2nd");
    assert!(leftovers(&d).is_empty());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn new_files_get_the_umask_mode_existing_ones_keep_theirs_and_folders_are_made() {
    let d = scratch("mode");
    let p = d.join("results/deep/a.safetensors");
    write("--save-output", &p, b"x").unwrap();
    // SAFETY: umask only reads and sets the process mask; set back at once.
    let mask = unsafe {
        let m = libc::umask(0o022);
        libc::umask(m);
        m
    };
    assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o666 & !(mask as u32));
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
    write("--save-output", &p, b"y").unwrap();
    assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o640);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_symlink_is_followed_not_replaced() {
    let d = scratch("link");
    let real = d.join("real.json");
    std::fs::write(&real, b"old").unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    write("--json", &link, b"new").unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read(&real).unwrap(), b"new");
    // A dangling link: the file it points to is created.
    let dangling = d.join("dangling.json");
    std::os::unix::fs::symlink(d.join("made.json"), &dangling).unwrap();
    write("--json", &dangling, b"made").unwrap();
    assert_eq!(std::fs::read(d.join("made.json")).unwrap(), b"made");
    std::fs::remove_dir_all(&d).ok();
}

/// A rename over a device or FIFO would replace the node with a file, so they are refused,
/// as are folders and read-only files (even for root, who could write them).
#[test]
fn devices_fifos_folders_and_read_only_files_are_refused_never_replaced() {
    let d = scratch("dev");
    for dev in ["/dev/null", "/dev/full"] {
        if std::fs::metadata(dev).is_ok_and(|m| m.file_type().is_char_device()) {
            let e = check("--json", Path::new(dev)).unwrap_err().to_string();
            assert!(e.contains(dev) && e.contains("in /dev") && e.contains("Fix:"), "{e}");
        }
    }
    let fifo = d.join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert!(check("--svg", &fifo).unwrap_err().to_string().contains("not a regular file"));
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    let e = check("--save-output", &d).unwrap_err().to_string();
    assert!(e.contains("is a directory") && e.contains("--save-output"), "{e}");
    let ro = d.join("ro.json");
    std::fs::write(&ro, b"keep").unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    let e = write("--json", &ro, b"new").unwrap_err().to_string();
    assert!(e.contains("read-only") && e.contains("ro.json"), "{e}");
    assert_eq!(std::fs::read(&ro).unwrap(), b"keep");
    assert!(leftovers(&d).is_empty());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn two_outputs_on_one_file_clash() {
    let d = scratch("clash");
    let a = d.join("same.out");
    let b = d.join("sub/../same.out");
    let e = check_all(&[("--json", &a), ("--svg", &b)]).unwrap_err().to_string();
    assert!(e.contains("--json") && e.contains("--svg") && e.contains("same file"), "{e}");
    let link = d.join("l");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    assert!(check_all(&[("--json", &a), ("--save-output", &link)]).is_err());
    assert!(check_all(&[("--json", &a), ("--svg", &d.join("other.svg"))]).is_ok());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_failed_write_leaves_no_temp() {
    // A rename that cannot happen (the target became a folder after the check).
    let d = scratch("fail");
    let p = d.join("x.json");
    let out = check("--json", &p).unwrap();
    std::fs::create_dir(&p).unwrap();
    std::fs::write(p.join("keep"), b"k").unwrap();
    let e = out.write(b"data").unwrap_err().to_string();
    assert!(e.contains("--json") && e.contains("x.json") && e.contains("Fix:"), "{e}");
    assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
    assert_eq!(std::fs::read(p.join("keep")).unwrap(), b"k");
    std::fs::remove_dir_all(&d).ok();
}

/// Bad names and folders that take no file are refused up front, and the check creates
/// nothing (no folder, no file) where it accepts.
#[test]
fn paths_are_checked_up_front_and_the_check_creates_nothing() {
    let d = scratch("paths");
    let p = d.join("b".repeat(250));
    write("--json", &p, b"x").unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"x");
    assert!(check("--json", &d.join("c".repeat(256))).is_err());
    let e = check("--json", &d.join("newname/")).unwrap_err().to_string();
    assert!(e.contains("ends in '/'"), "{e}");
    std::fs::write(d.join("afile"), b"").unwrap();
    let e = check("--json", &d.join("afile/x.json")).unwrap_err().to_string();
    assert!(e.contains("afile/x.json") && e.contains("Not a directory"), "{e}");
    for place in ["/proc/speedkit-x.json", "/dev/fd/987"] {
        if Path::new("/proc/self").exists() {
            let e = check("--json", Path::new(place)).unwrap_err().to_string();
            assert!(e.contains(place) && e.contains("not a file of its own") && e.contains("Fix:"), "{e}");
        }
    }
    check("--json", &d.join("new/deep/x.json")).unwrap();
    let mut left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["afile".into(), "b".repeat(250).into()] as [std::ffi::OsString; 2]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn fixes_match_the_cause() {
    let fix = |code| fix_for(&std::io::Error::from_raw_os_error(code));
    assert!(fix(libc::ENOSPC).contains("free space"));
    for code in [libc::EROFS, libc::EACCES, libc::EBADF] {
        assert!(!fix(code).contains("free space"), "{code}");
    }
}

#[test]
fn outputs_are_compared_with_inputs() {
    let d = scratch("inputs");
    let input = d.join("run.json");
    std::fs::write(&input, b"{}").unwrap();
    std::os::unix::fs::symlink(&input, d.join("alias.json")).unwrap();
    for same in [d.join("sub/../run.json"), d.join("alias.json")] {
        let outs = check_all(&[("--svg (the chart beside it)", &same)]).unwrap();
        let e = check_not_inputs(&outs, &[("--from", &input)]).unwrap_err().to_string();
        assert!(e.contains("--from") && e.contains("Fix: give --svg another path"), "{e}");
    }
    let outs = check_all(&[("--svg", &d.join("other.svg"))]).unwrap();
    assert!(check_not_inputs(&outs, &[("--from", &input), ("--input", Path::new("/dev/null"))]).is_ok());
    assert_eq!(std::fs::read(&input).unwrap(), b"{}");
    std::fs::remove_dir_all(&d).ok();
}

/// SIGTERM at any moment of the up-front check leaves no file beside the output: a child
/// process (this test binary, re-run) checks a path in a loop and is killed at a different
/// moment each round. Deterministic where the probe is unnamed (O_TMPFILE), so the test runs
/// in a folder whose file system has it (the temp dir, else /dev/shm) and says so otherwise.
#[cfg(target_os = "linux")]
#[test]
fn a_sigterm_during_the_check_leaves_no_file() {
    use std::io::BufRead;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::process::ExitStatusExt;
    if let Ok(dir) = std::env::var("SPEEDKIT_TEST_CHECK_LOOP") {
        let out = PathBuf::from(dir).join("new/out.json");
        check("--json", &out).unwrap();
        eprintln!("SPEEDKIT-CHECKING");
        loop {
            check("--json", &out).unwrap();
        }
    }
    let unnamed = |d: &Path| std::fs::OpenOptions::new().write(true).custom_flags(libc::O_TMPFILE).open(d).is_ok();
    let Some(base) = [std::env::temp_dir(), PathBuf::from("/dev/shm")].into_iter().find(|d| unnamed(d)) else {
        eprintln!("skipped: no folder here whose file system has O_TMPFILE");
        return;
    };
    let d = base.join(format!("speedkit-out-sigterm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for round in 0..20u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "output::tests::a_sigterm_during_the_check_leaves_no_file", "--nocapture", "--test-threads", "1"])
            .env("SPEEDKIT_TEST_CHECK_LOOP", &d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        assert!(stderr.lines().map_while(Result::ok).any(|l| l.contains("SPEEDKIT-CHECKING")), "the child never checked");
        std::thread::sleep(std::time::Duration::from_micros(round * 397));
        // SAFETY: kill sends a signal to our own child, whose pid we hold and have not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "round {round}: {left:?} left behind");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// A signal in the middle of a write leaves no temp file: a child (this test binary, re-run) with
/// `clean_up_on_signals` installed writes 8 MiB to one output in a loop and is sent SIGTERM,
/// SIGINT or SIGHUP at a different moment each round; afterwards the folder holds the output,
/// whole, or nothing, and the child ended by that signal.
#[cfg(target_os = "linux")]
#[test]
fn a_signal_mid_write_leaves_no_temp_file() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    const LEN: usize = 8 << 20;
    if let Ok(dir) = std::env::var("SPEEDKIT_TEST_WRITE_LOOP") {
        clean_up_on_signals();
        let out = PathBuf::from(dir).join("out.json");
        let bytes = vec![b'x'; LEN];
        write("--json", &out, &bytes).unwrap();
        eprintln!("SPEEDKIT-WRITING");
        loop {
            write("--json", &out, &bytes).unwrap();
        }
    }
    let d = scratch("signal-mid-write");
    for round in 0..24u64 {
        let sig = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP][round as usize % 3];
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "output::tests::a_signal_mid_write_leaves_no_temp_file", "--nocapture", "--test-threads", "1"])
            .env("SPEEDKIT_TEST_WRITE_LOOP", &d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        assert!(stderr.lines().map_while(Result::ok).any(|l| l.contains("SPEEDKIT-WRITING")), "the child never wrote");
        std::thread::sleep(std::time::Duration::from_micros(round * 1297));
        let mid_write = !leftovers(&d).is_empty(); // a temp file was there a moment before the signal
                                                   // SAFETY: kill sends a signal to our own child, whose pid we hold and have not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(sig), "round {round}: {status:?}");
        assert!(leftovers(&d).is_empty(), "round {round} (signal {sig}, mid-write {mid_write}): {:?} left behind", leftovers(&d));
        let out = d.join("out.json");
        assert_eq!(std::fs::metadata(&out).map(|m| m.len() as usize).unwrap_or(LEN), LEN, "round {round}: a partial output");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// Streams are not outputs: `-`, /dev/stdout and the like (as given or behind a link) are refused,
/// and nothing is written; the file a shell redirected stdout to is never replaced.
#[test]
fn streams_and_dash_are_refused() {
    let d = scratch("streams");
    let e = check("--json", Path::new("-")).unwrap_err().to_string();
    assert!(e.contains("--json -") && e.contains("not standard output") && e.contains("cat it"), "{e}");
    let mut places = vec!["/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/fd/1", "/dev/fd/2", "/dev/stdout-roofline.svg"];
    places.extend(Path::new("/proc/self").exists().then_some(["/proc/self/fd/1", "/proc/self/fd/2"]).into_iter().flatten());
    for place in places {
        for flag in ["--json", "--svg", "--save-weights", "--save-output"] {
            let e = check(flag, Path::new(place)).unwrap_err().to_string();
            assert!(e.contains(&format!("{flag} {place}")) && e.contains("not a file of its own"), "{e}");
            assert!(e.contains("write to a file and cat it") && e.contains(&format!("e.g. `{flag} out.")), "{e}");
        }
    }
    // Behind a link: to the stream itself, and through a linked folder.
    std::os::unix::fs::symlink("/dev/stdout", d.join("out.json")).unwrap();
    std::os::unix::fs::symlink("/dev/fd", d.join("fd")).unwrap();
    for p in [d.join("out.json"), d.join("fd/1")] {
        let e = check("--svg", &p).unwrap_err().to_string();
        assert!(e.contains("not a file of its own") && e.contains("cat it"), "{e}");
    }
    assert!(write("--json", &d.join("out.json"), b"x").is_err());
    assert!(std::fs::symlink_metadata(d.join("out.json")).unwrap().file_type().is_symlink());
    // Files are still fine: a link to a regular file, and a file in a folder under /dev (/dev/shm).
    std::fs::write(d.join("real.json"), b"old").unwrap();
    std::os::unix::fs::symlink(d.join("real.json"), d.join("link.json")).unwrap();
    write("--json", &d.join("link.json"), b"new").unwrap();
    assert_eq!(std::fs::read(d.join("real.json")).unwrap(), b"new");
    if Path::new("/dev/shm").is_dir() {
        check("--json", Path::new("/dev/shm/speedkit-never-written.json")).unwrap();
    }
    std::fs::remove_dir_all(&d).ok();
}
