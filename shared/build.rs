//! Embeds the git commit of the source tree at build time (SPEEDKIT_COMMIT), with "-dirty" when
//! source files differ from it, so a binary reports the commit it was built from wherever it
//! runs: on the first H100 run it read the commit at run time, in the current directory, and
//! reported "unknown" (outside its checkout) or another repository's commit (inside one).
//!
//! No git, or not a git checkout (a source tarball): "unknown", unless SPEEDKIT_COMMIT is set
//! in the build's environment (e.g. by a packaging script), which then wins.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).current_dir(dir).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=SPEEDKIT_COMMIT");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest.parent().unwrap_or(&manifest).to_path_buf();
    let commit = match std::env::var("SPEEDKIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => describe(&workspace).unwrap_or_else(|| "unknown".into()),
    };
    println!("cargo:rustc-env=SPEEDKIT_COMMIT={commit}");
}

/// "<12 hex>" or "<12 hex>-dirty", and the rerun-if-changed lines that keep it current.
fn describe(workspace: &Path) -> Option<String> {
    let head = git(workspace, &["rev-parse", "--short=12", "HEAD"])?;
    let top = PathBuf::from(git(workspace, &["rev-parse", "--show-toplevel"])?);
    // Rerun when HEAD moves (checkout, commit), the index changes (add, reset) or a source file
    // changes (the dirty flag). Results and Markdown do not count: recording a run must not
    // make the next build dirty.
    let mut watch: Vec<PathBuf> = Vec::new();
    for p in ["HEAD", "index", "packed-refs"] {
        watch.extend(git(workspace, &["rev-parse", "--path-format=absolute", "--git-path", p]).map(PathBuf::from));
    }
    if let Some(r) = git(workspace, &["symbolic-ref", "-q", "HEAD"]) {
        watch.extend(git(workspace, &["rev-parse", "--path-format=absolute", "--git-path", &r]).map(PathBuf::from));
    }
    for name in ["Cargo.toml", "Cargo.lock"] {
        watch.push(top.join(name));
    }
    if let Ok(entries) = std::fs::read_dir(&top) {
        for e in entries.flatten() {
            for sub in ["src", "kernels", "build.rs", "Cargo.toml", "tests", "benches"] {
                let p = e.path().join(sub);
                if e.path().is_dir() && p.exists() {
                    watch.push(p);
                }
            }
        }
    }
    for p in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    let clean = Command::new("git")
        .args(["diff", "--quiet", "HEAD", "--", ".", ":(exclude)results", ":(exclude)*.md"])
        .current_dir(&top)
        .status()
        .is_ok_and(|s| s.success());
    Some(if clean { head } else { head + "-dirty" })
}
