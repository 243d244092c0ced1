//! The one output policy every writer uses (`--json`, `--svg`, `--save-output`,
//! `--save-weights`, the README and the ladder's results files).
//!
//! 1. Every output path is checked before any work ([`check_all`]): it is not empty, not a
//!    directory, its folder is writable, and no two outputs land on the same file.
//! 2. A regular file or a new path is written to a temporary file beside it, then renamed over
//!    it: a reader never sees half a file, and a failed write leaves the old one intact.
//! 3. A symlink is followed: its target is written (the link stays a link).
//! 4. `/dev/stdout`, `/dev/stderr`, `/dev/null` and `/dev/fd/N` are written through, since that
//!    is what a user naming them means. Any other device node, FIFO or socket is refused —
//!    never replaced by a regular file.
//! 5. The temporary file is removed on every failure path: an error while writing or renaming
//!    (a full disk), and SIGINT/SIGTERM while it exists (a signal handler unlinks it).

use crate::error::SpeedkitError;
use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// Where the bytes for one output go.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// A regular file or a new path (absolute, symlinks resolved): temp file + rename.
    Replace(PathBuf),
    /// A stream the user named: written in place, never renamed over.
    Through(PathBuf),
}

/// One checked output: the flag that named it, the path as given, and where it resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub flag: String,
    pub path: PathBuf,
    target: Target,
}

fn refuse(flag: &str, path: &Path, why: &str, fix: &str) -> SpeedkitError {
    SpeedkitError::usage(format!("cannot write {flag} {}: {why}. Fix: {fix}.", path.display()))
}

/// Streams a user means to write into, not replace.
fn is_stream(path: &Path) -> bool {
    let s = path.to_string_lossy();
    matches!(s.as_ref(), "/dev/stdout" | "/dev/stderr" | "/dev/null" | "-")
        || s.strip_prefix("/dev/fd/").or_else(|| s.strip_prefix("/proc/self/fd/")).is_some_and(|n| n.parse::<u32>().is_ok())
}

/// `path` made absolute without touching the file system (".." and "." folded).
fn absolute(path: &Path) -> PathBuf {
    let joined = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(path) };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The absolute path `path` resolves to: symlinks followed (a dangling one to the file it
/// would create), the folder canonicalized where it exists. Two outputs clash when their
/// resolved paths are equal.
pub fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let mut p = absolute(path);
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)?;
                p = absolute(&p.parent().unwrap_or(Path::new("/")).join(to));
            }
            Ok(_) => return std::fs::canonicalize(&p),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A new file: canonicalize the nearest folder that exists, keep the rest.
                let mut rest = Vec::new();
                let mut dir = p.clone();
                while !dir.exists() {
                    match dir.file_name() {
                        Some(n) => rest.push(n.to_os_string()),
                        None => break,
                    }
                    if !dir.pop() {
                        break;
                    }
                }
                let mut out = std::fs::canonicalize(&dir).unwrap_or(dir);
                out.extend(rest.iter().rev());
                return Ok(out);
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("too many levels of symbolic links"))
}

/// `access(2)`: may this process write (and enter) `dir`?
fn writable_dir(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Check one output path (see the module's policy). Folders missing on the way to a new file
/// are allowed when the nearest existing one is writable: writers create them.
pub fn check(flag: &str, path: &Path) -> Result<Output, SpeedkitError> {
    let out = |target| Ok(Output { flag: flag.into(), path: path.to_path_buf(), target });
    if path.as_os_str().is_empty() {
        return Err(SpeedkitError::usage(format!("{flag} is an empty path. Fix: give a file name, e.g. {flag} out.json, or drop {flag}.")));
    }
    if is_stream(path) {
        // Opened now the way the write opens it, so a closed /dev/fd/N is refused before the run.
        probe_through(path).map_err(|e| {
            let fd = matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EBADF));
            let fix = if fd {
                "that file descriptor is not open in this process: open it in the shell (e.g. 99>out.json) or name a file".into()
            } else {
                fix_for(&e)
            };
            refuse(flag, path, &format!("it cannot be opened for writing ({e})"), &fix)
        })?;
        return out(Target::Through(path.to_path_buf()));
    }
    if path.as_os_str().as_bytes().ends_with(b"/") {
        // "newname/" names a folder; writing a file called "newname" would not be what was asked.
        return Err(refuse(
            flag,
            path,
            "it ends in '/', so it names a folder, not a file",
            &format!("name a file inside it, e.g. {}", path.join("out").display()),
        ));
    }
    if let Some(name) = path.file_name().filter(|n| n.len() > NAME_MAX) {
        return Err(refuse(
            flag,
            path,
            &format!("its file name is {} bytes, more than the {NAME_MAX} a file system takes", name.len()),
            "use a shorter file name",
        ));
    }
    let target = resolve(path).map_err(|e| refuse(flag, path, &format!("it cannot be resolved ({e})"), "pick another path"))?;
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => {
            return Err(refuse(flag, path, "it is a directory", &format!("name a file inside it, e.g. {}", path.join("out").display())))
        }
        Ok(m)
            if m.file_type().is_char_device()
                || m.file_type().is_block_device()
                || m.file_type().is_fifo()
                || m.file_type().is_socket() =>
        {
            return Err(refuse(
                flag,
                path,
                "it is a device, FIFO or socket, not a regular file, and an output is never replaced by a file",
                "write to a regular file (or /dev/stdout to print it)",
            ))
        }
        Ok(_) => {
            if let Err(e) = std::fs::OpenOptions::new().write(true).open(&target) {
                return Err(refuse(
                    flag,
                    path,
                    &format!("the file cannot be opened for writing ({e})"),
                    "check its permissions or pick another path",
                ));
            }
        }
        Err(_) => {}
    }
    // The temporary file is made in the target's folder (or the nearest one that exists).
    let mut dir = target.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
    while !dir.exists() {
        if !dir.pop() {
            break;
        }
    }
    if !dir.is_dir() {
        return Err(refuse(flag, path, &format!("{} is not a directory", dir.display()), "pick a path inside an existing folder"));
    }
    if !writable_dir(&dir) {
        return Err(refuse(
            flag,
            path,
            &format!("its folder {} is not writable", dir.display()),
            "pick a path in a folder you can write to",
        ));
    }
    // access(2) is not the write: /proc says "writable" to root and then refuses a new file, a
    // read-only mount may answer either way. So the temp file the write will make is created
    // (under the name it will have, in the folder it will be in) and removed at once.
    let probe = temp_name(&dir.join(target.file_name().unwrap_or_else(|| std::ffi::OsStr::new("out"))));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(f) => {
            drop(f);
            let _ = std::fs::remove_file(&probe);
        }
        Err(e) => {
            // The folder exists (found above), so "not found" here is a file system that takes
            // no new files, such as /proc or /sys.
            let fix = match e.raw_os_error() {
                Some(libc::ENOENT) => "pick a path on a file system that holds files (/proc and /sys do not)".to_string(),
                _ => fix_for(&e),
            };
            return Err(refuse(flag, path, &format!("a file cannot be created in {} ({e})", dir.display()), &fix));
        }
    }
    out(Target::Replace(target))
}

/// Open a stream target as `write_through` will (append), and close it again.
fn probe_through(path: &Path) -> std::io::Result<()> {
    let s = path.to_string_lossy();
    if matches!(s.as_ref(), "/dev/stdout" | "-" | "/dev/stderr") {
        return Ok(()); // our own stdout/stderr: written through the handles we hold
    }
    std::fs::OpenOptions::new().append(true).open(path).map(drop)
}

/// The fix that matches an I/O error's cause: a full disk wants space, a read-only or
/// forbidden place another path, a closed descriptor a shell redirection.
pub fn fix_for(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => "free space on that file system, or pick a path on another one".into(),
        Some(libc::EROFS) => "the file system is read-only: pick a path on a writable one".into(),
        Some(libc::EACCES) | Some(libc::EPERM) => "pick a path you may write to (or change its permissions)".into(),
        Some(libc::EBADF) | Some(libc::ENXIO) => {
            "that file descriptor is not open for writing in this process: open it in the shell (e.g. 99>out.json) or name a file".into()
        }
        Some(libc::ENAMETOOLONG) => "use a shorter path (a file name of at most 255 bytes, a path of at most 4096)".into(),
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => "pick a path inside a folder that exists and can hold files".into(),
        _ => "pick another path".into(),
    }
}

/// Longest file name (bytes) most Linux file systems take (NAME_MAX).
const NAME_MAX: usize = 255;

/// `.NAME.tmp-PID-N` beside `target`, with NAME cut (at a character boundary) so the whole
/// name stays within NAME_MAX: a legal 250-byte name must not fail only for its temp file.
fn temp_name(target: &Path) -> PathBuf {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tail = format!(".tmp-{}-{}", std::process::id(), TEMP_SEQ.fetch_add(1, Ordering::Relaxed));
    let room = NAME_MAX - 1 - tail.len();
    let mut cut = name.len().min(room);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    target.with_file_name(format!(".{}{tail}", &name[..cut]))
}

/// Refuse an output that is also an input of the run (`--from`, `--weights`, `--input`):
/// the run would overwrite what it reads.
pub fn check_not_inputs(outputs: &[Output], inputs: &[(&str, &Path)]) -> Result<(), SpeedkitError> {
    for (in_flag, in_path) in inputs {
        let Ok(read) = resolve(in_path) else { continue };
        for o in outputs {
            if o.resolved() == read && matches!(o.target, Target::Replace(_)) {
                return Err(SpeedkitError::usage(format!(
                    "{} {} is the {in_flag} file {} itself, so writing it would replace what the run reads. Fix: give {} another path.",
                    o.flag,
                    o.path.display(),
                    in_path.display(),
                    o.flag.split(' ').next().unwrap_or(&o.flag)
                )));
            }
        }
    }
    Ok(())
}

/// Is `path` a stream a user writes through (`/dev/stdout`, `/dev/fd/N`, ...)? Such a target
/// gets no sibling files (`chart-roofline.svg` beside `/dev/stdout` would be a stray file).
pub fn is_stream_target(path: &Path) -> bool {
    is_stream(path)
}

/// Check every output of a run at once: each alone, then that no two are one file.
pub fn check_all(outputs: &[(&str, &Path)]) -> Result<Vec<Output>, SpeedkitError> {
    let checked = outputs.iter().map(|(flag, path)| check(flag, path)).collect::<Result<Vec<_>, _>>()?;
    for (i, a) in checked.iter().enumerate() {
        for b in &checked[..i] {
            if let (Target::Replace(x), Target::Replace(y)) = (&a.target, &b.target) {
                if x == y {
                    return Err(SpeedkitError::usage(format!(
                        "{} {} and {} {} are the same file ({}), so one would overwrite the other. Fix: give each output its own path.",
                        b.flag,
                        b.path.display(),
                        a.flag,
                        a.path.display(),
                        x.display()
                    )));
                }
            }
        }
    }
    Ok(checked)
}

impl Output {
    /// The absolute path the bytes end up at (streams: the path as given).
    pub fn resolved(&self) -> &Path {
        match &self.target {
            Target::Replace(p) | Target::Through(p) => p,
        }
    }

    /// Write `bytes` by the policy; the error names the flag, the path and a fix (exit 2).
    pub fn write(&self, bytes: &[u8]) -> Result<(), SpeedkitError> {
        let result = match &self.target {
            Target::Through(p) => write_through(p, bytes),
            Target::Replace(p) => replace(p, bytes),
        };
        result.map_err(|e| refuse(&self.flag, &self.path, &format!("writing failed ({e}); nothing was left behind"), &fix_for(&e)))
    }
}

/// Check `path` and write `bytes` to it: for writers whose path was not checked up front.
pub fn write(flag: &str, path: &Path, bytes: &[u8]) -> Result<(), SpeedkitError> {
    check(flag, path)?.write(bytes)
}

fn write_through(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let s = path.to_string_lossy();
    if s == "/dev/stdout" || s == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(bytes)?;
        return out.flush();
    }
    if s == "/dev/stderr" {
        return std::io::stderr().lock().write_all(bytes);
    }
    // Append: a shell redirection behind /dev/fd/N keeps what was already written to it.
    std::fs::OpenOptions::new().append(true).open(path)?.write_all(bytes)
}

static TEMP_SEQ: AtomicUsize = AtomicUsize::new(0);

/// Temp file beside `target`, written whole and synced, then renamed over it.
fn replace(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = temp_name(target);
    let guard = TempGuard::new(&tmp);
    // Mode 0666 less the umask (0644 usually), like any file the shell creates; an existing
    // file keeps its own mode.
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    if let Ok(m) = std::fs::metadata(target) {
        f.set_permissions(std::fs::Permissions::from_mode(m.permissions().mode() & 0o7777))?;
    }
    f.write_all(bytes)?;
    f.sync_all()?; // a full disk can first show here
    drop(f);
    std::fs::rename(&tmp, target)?;
    guard.disarm();
    Ok(())
}

/// Removes its temp file when dropped (any `?` above), and while it lives the file is listed
/// for the SIGINT/SIGTERM handler.
struct TempGuard {
    path: PathBuf,
    slot: Option<usize>,
    armed: bool,
}

impl TempGuard {
    fn new(path: &Path) -> TempGuard {
        TempGuard { path: path.to_path_buf(), slot: signals::register(path), armed: true }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
        if let Some(slot) = self.slot {
            signals::unregister(slot);
        }
    }
}

/// Temp files alive right now, for the signal handler: a fixed table of C strings, since a
/// handler may only do async-signal-safe things (load a pointer, unlink, raise).
pub(crate) mod signals {
    use super::*;

    const SLOTS: usize = 16;
    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());
    static TEMPS: [AtomicPtr<libc::c_char>; SLOTS] = [EMPTY; SLOTS];
    static INSTALL: std::sync::Once = std::sync::Once::new();

    extern "C" fn on_signal(sig: libc::c_int) {
        for slot in &TEMPS {
            let p = slot.load(Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: `p` is a leaked, NUL-terminated CString until `unregister` frees it,
                // which happens only after the slot is cleared; unlink is async-signal-safe.
                unsafe { libc::unlink(p) };
            }
        }
        // SAFETY: restore the default action and re-raise, so the process ends as the signal
        // says (exit status 128 + sig in a shell); both calls are async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }

    fn install() {
        INSTALL.call_once(|| {
            for sig in [libc::SIGINT, libc::SIGTERM] {
                // SAFETY: installing a handler that only does async-signal-safe work.
                unsafe { libc::signal(sig, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t) };
            }
        });
    }

    /// List `path`; `None` when the table is full (the file is then only removed on errors).
    pub fn register(path: &Path) -> Option<usize> {
        install();
        let c = CString::new(path.as_os_str().as_bytes()).ok()?.into_raw();
        for (i, slot) in TEMPS.iter().enumerate() {
            if slot.compare_exchange(std::ptr::null_mut(), c, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                return Some(i);
            }
        }
        // SAFETY: `c` came from `into_raw` above and was not stored.
        drop(unsafe { CString::from_raw(c) });
        None
    }

    pub fn unregister(slot: usize) {
        let p = TEMPS[slot].swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` came from `CString::into_raw` in `register`.
            drop(unsafe { CString::from_raw(p) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("speedkit-out-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
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
    fn new_files_get_the_umask_mode_and_folders_are_made() {
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

    #[test]
    fn devices_fifos_and_directories_are_refused_never_replaced() {
        let d = scratch("dev");
        if std::fs::metadata("/dev/full").is_ok_and(|m| m.file_type().is_char_device()) {
            let e = check("--json", Path::new("/dev/full")).unwrap_err().to_string();
            assert!(e.contains("/dev/full") && e.contains("device") && e.contains("Fix:"), "{e}");
        }
        let fifo = d.join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid path; mkfifo only creates a node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        assert!(check("--svg", &fifo).unwrap_err().to_string().contains("FIFO"));
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        let e = check("--save-output", &d).unwrap_err().to_string();
        assert!(e.contains("is a directory") && e.contains("--save-output"), "{e}");
        assert!(leftovers(&d).is_empty());
        // Streams a user names are written through.
        write("--json", Path::new("/dev/null"), b"gone").unwrap();
        assert!(check("--json", Path::new("/dev/stdout")).is_ok());
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
        assert!(check_all(&[("--json", Path::new("/dev/stdout")), ("--svg", Path::new("/dev/stdout"))]).is_ok());
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temp() {
        // Only where /dev/full is the device (the write-through below would append to a file).
        if !std::fs::metadata("/dev/full").is_ok_and(|m| m.file_type().is_char_device()) {
            return;
        }
        // Writing through a stream that fails: the error names the flag and path.
        let e = Output { flag: "--json".into(), path: "/dev/full".into(), target: Target::Through("/dev/full".into()) }
            .write(&[0u8; 1 << 16])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--json /dev/full") && e.contains("Fix:"), "{e}");
        // A rename that cannot happen (target became a directory after the check): temp removed.
        let d = scratch("fail");
        let p = d.join("x.json");
        let out = check("--json", &p).unwrap();
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("keep"), b"k").unwrap();
        assert!(out.write(b"data").is_err());
        assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
        std::fs::remove_dir_all(&d).ok();
    }

    // Issue 19, class E: a legal long name's temp file stays within NAME_MAX, and the check
    // probes the folder the way the write will (a closed /dev/fd/N, /proc).
    #[test]
    fn long_names_fit_and_checks_probe_the_real_write() {
        let d = scratch("long");
        for len in [1, 200, 250, 255] {
            let p = d.join("é".repeat(len / 2) + &"a".repeat(len % 2));
            let tmp = temp_name(&p);
            assert!(tmp.file_name().unwrap().len() <= NAME_MAX, "{len}: {}", tmp.display());
            assert!(std::str::from_utf8(tmp.file_name().unwrap().as_bytes()).is_ok(), "cut at a character boundary");
        }
        let p = d.join("b".repeat(250));
        write("--json", &p, b"x").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"x");
        assert!(leftovers(&d).is_empty());
        let e = check("--json", &d.join("c".repeat(256))).unwrap_err().to_string();
        assert!(e.contains("256 bytes") && e.contains("Fix: use a shorter"), "{e}");
        if Path::new("/proc/self").exists() {
            let e = check("--json", Path::new("/proc/speedkit-x.json")).unwrap_err().to_string();
            assert!(e.contains("/proc") && !e.contains("free space"), "{e}");
        }
        // fd 987 is not open in a test process.
        let e = check("--json", Path::new("/dev/fd/987")).unwrap_err().to_string();
        assert!(e.contains("file descriptor is not open"), "{e}");
        // A trailing '/' names a folder (class H): never a file called "newname".
        let e = check("--json", &d.join("newname/")).unwrap_err().to_string();
        assert!(e.contains("ends in '/'"), "{e}");
        assert!(leftovers(&d).is_empty(), "the probe's file is removed");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn fixes_match_the_cause() {
        let fix = |code| fix_for(&std::io::Error::from_raw_os_error(code));
        assert!(fix(libc::ENOSPC).contains("free space"));
        for code in [libc::EROFS, libc::EACCES, libc::EBADF, libc::ENAMETOOLONG] {
            assert!(!fix(code).contains("free space"), "{code}");
        }
    }

    // Issue 19, class C: an output that is an input is refused, through links and "..".
    #[test]
    fn outputs_are_compared_with_inputs() {
        let d = scratch("inputs");
        let input = d.join("run.json");
        std::fs::write(&input, b"{}").unwrap();
        let outs = check_all(&[("--svg (the chart beside it)", &d.join("sub/../run.json"))]).unwrap();
        let e = check_not_inputs(&outs, &[("--from", &input)]).unwrap_err().to_string();
        assert!(e.contains("--from") && e.contains("Fix: give --svg another path"), "{e}");
        let outs = check_all(&[("--svg", &d.join("other.svg")), ("--json", Path::new("/dev/null"))]).unwrap();
        assert!(check_not_inputs(&outs, &[("--from", &input), ("--input", Path::new("/dev/null"))]).is_ok());
        assert!(is_stream_target(Path::new("/dev/stdout")) && !is_stream_target(&input));
        std::fs::remove_dir_all(&d).ok();
    }

    /// SIGTERM while a temp file exists: the child process (this test binary, re-run) is killed
    /// by the signal and its temp file is gone.
    #[test]
    fn a_signal_removes_the_temp_file() {
        if let Ok(tmp) = std::env::var("SPEEDKIT_TEST_SIGNAL_CHILD") {
            let tmp = PathBuf::from(tmp);
            std::fs::write(&tmp, b"partial").unwrap();
            let _guard = TempGuard::new(&tmp);
            // SAFETY: raising a signal at ourselves; the handler re-raises it with SIG_DFL.
            unsafe { libc::raise(libc::SIGTERM) };
            unreachable!("SIGTERM ends the process");
        }
        let d = scratch("sig");
        let tmp = d.join(".x.json.tmp-child");
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "output::tests::a_signal_removes_the_temp_file", "--nocapture", "--test-threads", "1"])
            .env("SPEEDKIT_TEST_SIGNAL_CHILD", &tmp)
            .output()
            .unwrap()
            .status;
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
        assert!(!tmp.exists());
        std::fs::remove_dir_all(&d).ok();
    }
}
