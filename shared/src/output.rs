//! The one output policy every writer uses (`--json`, `--svg`, `--save-*`, what `--update-readme`
//! rewrites). Every path is checked before any work ([`check_all`], [`check_not_inputs`]). The
//! bytes go to a temp file beside it, renamed over it, so a reader sees the old file or the new
//! one; on any error the temp file is deleted and the old file is intact. A symlink's target is replaced.

use crate::error::SpeedkitError;
use std::io::{ErrorKind, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

/// One checked output: the flag that named it, the path as given, the file it resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub flag: String,
    pub path: PathBuf,
    target: PathBuf,
}

fn refuse(flag: &str, path: &Path, why: &str, fix: &str) -> SpeedkitError {
    SpeedkitError::usage(format!("cannot write {flag} {}: {why}. Fix: {fix}.", path.display()))
}

fn fix_for(e: &std::io::Error) -> &'static str {
    match e.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded => "free space on that file system, or pick a path on another one",
        ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => "pick a path you may write to",
        _ => "pick another path",
    }
}

/// `path` made absolute without touching the file system (".." folded, so a new folder may be in it).
fn absolute(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in std::env::current_dir().unwrap_or_default().join(path).components() {
        match c {
            Component::ParentDir => _ = out.pop(),
            c => out.push(c),
        }
    }
    out
}

/// The absolute file `path` names (two paths name one file when these are equal): symlinks followed
/// (a dangling one to the file it would create), the nearest folder that exists canonicalized.
pub fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let mut p = absolute(path);
    for _ in 0..40 {
        match std::fs::read_link(&p) {
            Ok(to) if !p.exists() => p = absolute(&p.parent().unwrap_or(Path::new("/")).join(to)),
            _ => break,
        }
    }
    let mut dir = p.clone();
    while !dir.exists() && dir.pop() {}
    let mut out = std::fs::canonicalize(&dir)?;
    out.extend(p.strip_prefix(&dir).into_iter().flat_map(Path::components));
    Ok(out)
}

/// Where `path`, or a symlink it leads through, is a stream or process entry rather than a file:
/// `/dev/stdout`, `/dev/stderr`, `/dev/stdin`, anything in `/dev/fd` or `/proc`, or a name directly in
/// `/dev` (device nodes, never outputs; `/dev/shm`'s files are fine). Looked at as given and after each
/// link, each with its folder canonicalized, so `fd/1` with `fd -> /dev/fd` is caught too.
fn stream_behind(path: &Path) -> Option<String> {
    let is_stream = |p: &Path| {
        let parent = p.parent().unwrap_or(Path::new("/"));
        let folder = std::fs::canonicalize(parent).unwrap_or_else(|_| parent.to_path_buf());
        let dev = [Path::new("/dev"), Path::new("/dev/fd")].iter().any(|d| *d == parent || *d == folder);
        let proc = [parent, folder.as_path()].iter().any(|f| f.starts_with("/proc"));
        (dev || proc || p.starts_with("/proc") || p.starts_with("/dev/fd")).then(|| match p.to_str() {
            Some("/dev/stdout") => "standard output".to_string(),
            Some("/dev/stderr") => "standard error".to_string(),
            Some("/dev/stdin") => "standard input".to_string(),
            _ if proc || p.starts_with("/proc") => format!("{} under /proc (a process's entry)", p.display()),
            _ => format!("{} in /dev (a device or an open file descriptor)", p.display()),
        })
    };
    let mut p = absolute(path);
    for _ in 0..40 {
        if let Some(place) = is_stream(&p) {
            return Some(place);
        }
        let Ok(to) = std::fs::read_link(&p) else { break };
        p = absolute(&p.parent().unwrap_or(Path::new("/")).join(to));
    }
    None
}

/// Check one output path. Missing folders are fine when the nearest one that exists can take a
/// file: the write creates them.
pub fn check(flag: &str, path: &Path) -> Result<Output, SpeedkitError> {
    let no = |why: &str, fix: &str| Err(refuse(flag, path, why, fix));
    if path.as_os_str().is_empty() {
        return Err(SpeedkitError::usage(format!("{flag} is an empty path. Fix: give a file name, e.g. {flag} out.json, or drop {flag}.")));
    }
    // "--svg (the chart beside it)" -> --svg; --update-readme's own JSON -> --json.
    let bare = flag.split(' ').next().filter(|f| *f != "--update-readme").unwrap_or("--json");
    let file = match bare {
        "--svg" => "out.svg",
        "--save-weights" | "--save-output" => "out.safetensors",
        "--readme" => "README.md",
        _ => "out.json",
    };
    let stream = format!("Fix: write to a file and cat it, e.g. `{bare} {file}` then `cat {file}`");
    if path.as_os_str() == "-" {
        return Err(SpeedkitError::usage(format!(
            "{flag} -: outputs are files, and '-' would be a file named '-' in this folder, not standard output. {stream}."
        )));
    }
    if let Some(place) = stream_behind(path) {
        return Err(SpeedkitError::usage(format!(
            "cannot write {flag} {}: it is {place}, not a file of its own. An output is written to a temp file renamed \
             over its path (or the file a link points to), which here would replace the device or the file the stream \
             was sent to, and the charts beside --svg would be made in that folder. {stream}.",
            path.display()
        )));
    }
    let inside = format!("name a file inside it, e.g. {}", path.join("out").display());
    // "newname/" names a folder; writing a file called "newname" would not be what was asked.
    if path.as_os_str().as_bytes().ends_with(b"/") {
        return no("it ends in '/', so it names a folder, not a file", &inside);
    }
    let target = resolve(path).map_err(|e| refuse(flag, path, &format!("it cannot be resolved ({e})"), fix_for(&e)))?;
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => return no("it is a directory", &inside),
        // The rename would replace the node itself (root may replace /dev/null), never write into it.
        Ok(m) if !m.is_file() => return no("it is not a regular file", "name a regular file"),
        Ok(m) if m.permissions().readonly() => return no("it is read-only", "make it writable (chmod u+w) or pick another path"),
        Err(e) if e.kind() != ErrorKind::NotFound => return no(&format!("it cannot be looked up ({e})"), fix_for(&e)),
        _ => {}
    }
    let mut dir = target.parent().unwrap_or(Path::new("/")).to_path_buf();
    while !dir.exists() && dir.pop() {}
    // Asked of the folder itself (permissions, a read-only mount, /proc) with an unnamed file
    // (O_TMPFILE), which leaves no name behind even if a signal ends the process here.
    if let Err(e) = tempfile::tempfile_in(&dir) {
        return no(&format!("a file cannot be created in {} ({e})", dir.display()), fix_for(&e));
    }
    Ok(Output { flag: flag.into(), path: path.to_path_buf(), target })
}

/// Refuse an output that is also an input of the run (`--from`, `--weights`, `--input`).
pub fn check_not_inputs(outputs: &[Output], inputs: &[(&str, &Path)]) -> Result<(), SpeedkitError> {
    for (in_flag, in_path) in inputs {
        let Ok(read) = resolve(in_path) else { continue };
        if let Some(Output { flag, path, .. }) = outputs.iter().find(|o| o.target == read) {
            let (path, in_path, bare) = (path.display(), in_path.display(), flag.split(' ').next().unwrap_or(flag));
            return Err(SpeedkitError::usage(format!(
                "{flag} {path} is the {in_flag} file {in_path} itself, so writing it would replace what the run reads. Fix: give {bare} another path."
            )));
        }
    }
    Ok(())
}

/// Check every output of a run at once: each alone, then that no two are one file.
pub fn check_all(outputs: &[(&str, &Path)]) -> Result<Vec<Output>, SpeedkitError> {
    let checked = outputs.iter().map(|(flag, path)| check(flag, path)).collect::<Result<Vec<_>, _>>()?;
    for (i, a) in checked.iter().enumerate() {
        if let Some(b) = checked[..i].iter().find(|b| b.target == a.target) {
            let (bp, ap, file) = (b.path.display(), a.path.display(), a.target.display());
            return Err(SpeedkitError::usage(format!(
                "{} {bp} and {} {ap} are the same file ({file}), so one would overwrite the other. Fix: give each output its own path.",
                b.flag, a.flag
            )));
        }
    }
    Ok(checked)
}

impl Output {
    /// Write `bytes` by the policy (exit 2 naming the flag, the path and a fix).
    pub fn write(&self, bytes: &[u8]) -> Result<(), SpeedkitError> {
        replace(&self.target, bytes).map_err(|e| {
            refuse(&self.flag, &self.path, &format!("writing failed ({e}); the old file is intact, no temp file left"), fix_for(&e))
        })
    }
}

/// Check `path` and write `bytes` to it: for writers whose path was not checked up front.
pub fn write(flag: &str, path: &Path, bytes: &[u8]) -> Result<(), SpeedkitError> {
    check(flag, path)?.write(bytes)
}

/// Temp files being written right now: what the signal thread (`clean_up_on_signals`) removes
/// when SIGINT, SIGTERM or SIGHUP ends the process in the middle of a write.
static PENDING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn pending() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// From now on a SIGINT, SIGTERM or SIGHUP first deletes the temp file being written, if any,
/// then ends the process as the signal would have (its default action, so the exit status still
/// says which signal). A thread receives the signal, so the removal is ordinary code, not a signal
/// handler's; it holds `PENDING`'s lock from the removal to the end, so no write starts a temp file
/// after it. Every binary calls this first thing; calling it again does nothing.
pub fn clean_up_on_signals() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else { return };
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                let files = pending();
                for f in files.iter() {
                    let _ = std::fs::remove_file(f);
                }
                let _ = signal_hook::low_level::emulate_default_handler(sig);
                std::process::exit(128 + sig); // not reached: the default action ends the process
            }
        });
    });
}

/// A temp file beside `target`, written whole and synced, then renamed over it.
fn replace(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = target.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    // Created and registered under one lock, so a signal finds it either not yet made or listed.
    let mut files = pending();
    // Mode 0666 less the umask, like a file the shell creates (tempfile's is 0600); an existing file keeps its mode.
    let mut tmp = tempfile::Builder::new().permissions(std::fs::Permissions::from_mode(0o666)).tempfile_in(dir)?;
    let path = tmp.path().to_path_buf();
    files.push(path.clone());
    drop(files);
    let result = (move || -> std::io::Result<()> {
        if let Ok(m) = std::fs::metadata(target) {
            tmp.as_file().set_permissions(m.permissions())?;
        }
        tmp.write_all(bytes)?;
        tmp.as_file().sync_all()?; // a full disk can first show here
        tmp.persist(target)?; // on an error the temp file is dropped, which deletes it
        Ok(())
    })();
    pending().retain(|p| p != &path); // renamed or deleted by now: nothing left to clean up
    result
}

#[cfg(test)]
#[path = "../tests/unit/output.rs"]
mod tests;
