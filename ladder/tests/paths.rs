//! Every repository path the docs and the code comments name exists. A reader who follows
//! `stage3_fused/src/ops.rs` from the README, or `host_emulation/run.sh` from a kernel's comment,
//! should land on a file, not on a path that moved.
//!
//! Scanned: README.md and docs/*.md (all of their text, code blocks included, and every relative
//! link target outside code blocks, resolved from the page's folder), and the comments of every *.rs, *.cu, *.h,
//! *.cpp, *.sh and *.py file under the repository (`//`, `/* */`; `#` in shell and Python),
//! outside target/, .git/ and results/. Not scanned: CHANGELOG.md, which names paths as they
//! were, and this file, whose comments and tests hold example paths on purpose.
//!
//! A token is a repository path when it starts (after any `./` or `../`) with one of
//! `TOP_LEVEL_DIRS` followed by `/`, or is one of `TOP_LEVEL_FILES`, or is a bare upper-case
//! `NAME.md` (a root document such as README.md). Before the check, trailing punctuation
//! (`.,:;!?)`), a `:LINE` or `:LINE-LINE` suffix, a `::item` suffix and a `#anchor` are
//! stripped; the path must then exist, as a file or a folder, relative to the repository root.
//!
//! Skipped as templates, not paths (`is_template`):
//! - a glob or brace set: `*`, `?`, `{`, `}` (`results/ladder-*.{json,svg}`);
//! - a placeholder: `<`, `>` (`candle-speedkit-gpu-<commit>.tar.gz`), `$` (`$MKLROOT/lib`),
//!   `…` or `...`, and a path component that is `N`, `X` or ends in an upper-case `N`/`X` after
//!   lower-case letters (`stageN/src/lib.rs`, `sm_XX`);
//! - a URL (`://`).
//!
//! Tokens are split at whitespace, quotes, brackets, `|`, `,`, `;` and `=` (`--json=results/x.json`
//! names `results/x.json`).

use std::path::{Path, PathBuf};

/// Top-level folders a path may start with. Listed, not read from the disk, so a path into a
/// folder that was removed (say `examples/`) is reported rather than skipped.
const TOP_LEVEL_DIRS: &[&str] = &[
    "shared",
    "stage0_baseline",
    "stage1_tensorcore",
    "stage2_sdpa",
    "stage3_fused",
    "stage4_fp8",
    "ladder",
    "docs",
    "scripts",
    "host_emulation",
    "results",
    "examples",
    ".ci",
];

/// Top-level files a bare token may name.
const TOP_LEVEL_FILES: &[&str] =
    &["README.md", "CHANGELOG.md", "Dockerfile", "Cargo.toml", "Cargo.lock", "rustfmt.toml", ".dockerignore", ".gitignore"];

/// Folders not scanned for code comments.
const SKIP_DIRS: &[&str] = &["target", ".git", "results"];

/// This file: its comments and tests name example paths, some missing on purpose.
const SELF: &str = "ladder/tests/paths.rs";

const CODE_EXTS: &[&str] = &["rs", "cu", "h", "cpp", "sh", "py"];

fn root() -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).canonicalize().unwrap()
}

/// A path named somewhere: the file and line that name it, and the path as written.
#[derive(Debug)]
struct Named {
    file: String,
    line: usize,
    path: String,
}

/// Characters that end a token: whitespace, quotes, brackets, markdown and list punctuation.
fn is_separator(c: char) -> bool {
    c.is_whitespace() || "`\"'()[]|,;=’‘“”".contains(c)
}

/// A template or a URL, not a path (see the module comment for the list).
fn is_template(token: &str) -> bool {
    if token.contains("://") || token.contains("...") {
        return true;
    }
    if token.chars().any(|c| "*?{}<>$…".contains(c)) {
        return true;
    }
    token.split('/').any(|part| {
        let stem = part.split('.').next().unwrap_or("");
        let body = stem.trim_end_matches(['N', 'X']);
        stem == "N" || stem == "X" || (body.len() < stem.len() && body.ends_with(|c: char| c.is_ascii_lowercase() || c == '_'))
    })
}

/// `token` cleaned up as a repository path, or None when it does not look like one.
fn as_repo_path(token: &str) -> Option<String> {
    let mut t = token;
    // Trailing prose punctuation, and a colon that starts a `:LINE` suffix.
    t = t.trim_end_matches(['.', ',', ':', ';', '!', '?', ')']);
    let mut t = t.to_string();
    if let Some(i) = t.find('#') {
        t.truncate(i);
    }
    if let Some(i) = t.find("::") {
        t.truncate(i);
    }
    // `:LINE` or `:LINE-LINE`.
    if let Some((head, tail)) = t.rsplit_once(':') {
        if !tail.is_empty() && tail.chars().all(|c| c.is_ascii_digit() || c == '-') {
            t = head.to_string();
        }
    }
    let t = t.trim_end_matches(['.', ',', ':', ';', '!', '?']);
    let mut s = t;
    loop {
        if let Some(r) = s.strip_prefix("./") {
            s = r;
        } else if let Some(r) = s.strip_prefix("../") {
            s = r;
        } else {
            break;
        }
    }
    if s.is_empty() || is_template(s) {
        return None;
    }
    let first = s.split('/').next().unwrap();
    let in_dir = s.contains('/') && TOP_LEVEL_DIRS.contains(&first);
    let top_file = !s.contains('/') && TOP_LEVEL_FILES.contains(&s);
    let root_doc = !s.contains('/')
        && s.strip_suffix(".md").is_some_and(|stem| !stem.is_empty() && stem.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
    (in_dir || top_file || root_doc).then(|| s.to_string())
}

/// The repository paths in one line of text.
fn paths_in(text: &str) -> Vec<String> {
    text.split(is_separator).filter_map(as_repo_path).collect()
}

/// The comment text of a C-family or Rust source, line by line (code blanked out), so line
/// numbers stay those of the file. String and character literals are skipped, so a `"//"` in
/// code starts no comment.
fn c_comments(src: &str) -> Vec<String> {
    let chars: Vec<char> = src.chars().collect();
    let mut lines = vec![String::new()];
    let (mut i, mut in_line, mut in_block) = (0, false, false);
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            lines.push(String::new());
            in_line = false;
            i += 1;
            continue;
        }
        if in_line || in_block {
            if in_block && c == '*' && next == Some('/') {
                in_block = false;
                lines.last_mut().unwrap().push(' ');
                i += 2;
                continue;
            }
            lines.last_mut().unwrap().push(c);
            i += 1;
            continue;
        }
        match (c, next) {
            ('/', Some('/')) => {
                in_line = true;
                i += 2;
            }
            ('/', Some('*')) => {
                in_block = true;
                i += 2;
            }
            ('"', _) => {
                // A string literal (escapes honoured); newlines inside it still count.
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    } else if chars[i] == '\n' {
                        lines.push(String::new());
                    }
                    i += 1;
                }
                i += 1;
            }
            ('\'', _) => {
                // A char literal ('x', '\n', '\''); otherwise a Rust lifetime, left alone.
                if chars.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < chars.len() && chars[i] != '\'' && chars[i] != '\n' {
                        i += 1;
                    }
                    i += 1;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    lines
}

/// The `#` comments of a shell or Python file, line by line: from a `#` at the start of the
/// line or after whitespace (so `$#` and `${#x}` are code).
fn hash_comments(src: &str) -> Vec<String> {
    src.lines()
        .map(|line| {
            let mut prev = ' ';
            for (i, c) in line.char_indices() {
                if c == '#' && prev.is_whitespace() {
                    return line[i + 1..].to_string();
                }
                prev = c;
            }
            String::new()
        })
        .collect()
}

/// The targets of markdown links `](target)` on a line, without a `"title"`.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split(" \"").next().unwrap_or("").trim();
        out.push(target.to_string());
        rest = &rest[end..];
    }
    out
}

fn rel(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// Every path README.md and docs/*.md name, and every relative link target they hold.
fn named_in_docs(root: &Path) -> Vec<Named> {
    let mut out = Vec::new();
    for page in pages(root) {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        let mut fenced = false;
        for (n, line) in text.lines().enumerate() {
            let file = rel(root, &page);
            for path in paths_in(line) {
                out.push(Named { file: file.clone(), line: n + 1, path });
            }
            // A link in a code block is an example of the syntax, not a link of this page.
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
            }
            if fenced {
                continue;
            }
            for target in link_targets(line) {
                let target = target.split('#').next().unwrap_or("");
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") || is_template(target) {
                    continue;
                }
                // Relative to the page: resolved here, reported as the repository path.
                let resolved = dir.join(target);
                let shown = match resolved.canonicalize() {
                    Ok(p) => rel(root, &p),
                    Err(_) => format!("{target} (from {})", rel(root, dir)),
                };
                if !resolved.exists() {
                    out.push(Named { file: file.clone(), line: n + 1, path: shown });
                }
            }
        }
    }
    out
}

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            if !SKIP_DIRS.contains(&name.as_str()) {
                source_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| CODE_EXTS.contains(&x.to_string_lossy().as_ref())) && !p.ends_with(SELF) {
            out.push(p);
        }
    }
}

/// Every path named in a code comment.
fn named_in_code(root: &Path) -> Vec<Named> {
    let mut files = Vec::new();
    source_files(root, &mut files);
    let mut out = Vec::new();
    for f in files {
        let Ok(src) = std::fs::read_to_string(&f) else { continue };
        let ext = f.extension().unwrap().to_string_lossy().to_string();
        let comments = if ext == "sh" || ext == "py" { hash_comments(&src) } else { c_comments(&src) };
        for (n, line) in comments.iter().enumerate() {
            for path in paths_in(line) {
                out.push(Named { file: rel(root, &f), line: n + 1, path });
            }
        }
    }
    out
}

/// The named paths that do not exist, one line each: `file:line → path`.
fn missing(root: &Path, named: &[Named]) -> Vec<String> {
    named
        .iter()
        .filter(|n| n.path.contains(" (from ") || !root.join(&n.path).exists())
        .map(|n| format!("{}:{} → {}", n.file, n.line, n.path))
        .collect()
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = root();
    let named = named_in_docs(&root);
    assert!(named.iter().any(|n| n.path == "stage0_baseline/src/lib.rs"), "the README's stage 0 path is found");
    let bad = missing(&root, &named);
    assert!(bad.is_empty(), "README.md and docs/*.md name paths that do not exist:\n{}", bad.join("\n"));
}

/// Strict, like the docs test: every repository path a comment in the code names exists.
#[test]
fn every_path_a_code_comment_names_exists() {
    let root = root();
    let named = named_in_code(&root);
    assert!(!named.is_empty(), "code comments name repository paths");
    let bad = missing(&root, &named);
    assert!(bad.is_empty(), "code comments name paths that do not exist:\n{}", bad.join("\n"));
}

#[test]
fn tokens_are_read_as_paths() {
    let p = |s: &str| paths_in(s);
    assert_eq!(p("see `shared/src/graph.rs`."), ["shared/src/graph.rs"]);
    assert_eq!(p("(stage3_fused/src/ops.rs:120-140, and docs/gpu.md#first-run)"), ["stage3_fused/src/ops.rs", "docs/gpu.md"]);
    assert_eq!(p("[x](../results/ladder-cpu.json \"records[0]\")"), ["results/ladder-cpu.json"]);
    assert_eq!(p("shared::elementwise and stage2_sdpa/src/attention.rs::View"), ["stage2_sdpa/src/attention.rs"]);
    assert_eq!(p("README.md, DESIGN.md and Cargo.toml; notes.md and src/lib.rs"), ["README.md", "DESIGN.md", "Cargo.toml"]);
    // Templates and URLs are skipped.
    assert!(p("results/ladder-*.{json,svg} stageN/src/lib.rs https://x.org/shared/a docs/<page>.md $MKLROOT/lib").is_empty());
    assert!(p("results/ladder-cpu.json").len() == 1 && is_template("sm_XX") && is_template("docs/N.md"));
}

#[test]
fn comments_are_found_and_code_is_not() {
    let src = "let s = \"// shared/not_a_comment.rs\"; // shared/yes.rs\nlet c = '/'; /* docs/\nblock.md */ x\nfn f<'a>(x: &'a str) {} // ladder/z.rs\n";
    let lines = c_comments(src);
    assert_eq!(paths_in(&lines[0]), ["shared/yes.rs"]);
    assert_eq!(paths_in(&lines[1]), ["docs/"]);
    assert_eq!(paths_in(&lines[3]), ["ladder/z.rs"]);
    let sh = hash_comments("echo $# # scripts/a.sh\nx=${#y}\n# docs/b.md\n");
    assert_eq!(paths_in(&sh[0]), ["scripts/a.sh"]);
    assert!(paths_in(&sh[1]).is_empty());
    assert_eq!(paths_in(&sh[2]), ["docs/b.md"]);
}

/// "issue 13", "finding 8", "issue #22" — development history, which lives in CHANGELOG.md. An
/// upstream project's bug (`candle issue #3886`, `huggingface/candle#3886`) is a reference, not
/// history, and is allowed.
fn history_refs(line: &str) -> Vec<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let w = w.trim_start_matches(['(', '[']).to_ascii_lowercase();
        let next = words.get(i + 1).map(|n| n.trim_start_matches('#'));
        let numbered = next.is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()));
        let upstream = i > 0 && words[i - 1].eq_ignore_ascii_case("candle");
        if ["issue", "issues", "finding", "findings"].contains(&w.as_str()) && numbered && !upstream {
            out.push(format!("{w} {}", words[i + 1]));
        }
    }
    out
}

#[test]
fn no_development_history_in_docs_or_comments() {
    let root = root();
    let mut bad = Vec::new();
    for page in pages(&root) {
        for (n, line) in std::fs::read_to_string(&page).unwrap().lines().enumerate() {
            bad.extend(history_refs(line).into_iter().map(|r| format!("{}:{} → {r}", rel(&root, &page), n + 1)));
        }
    }
    let mut files = Vec::new();
    source_files(&root, &mut files);
    for f in files {
        let Ok(src) = std::fs::read_to_string(&f) else { continue };
        let ext = f.extension().unwrap().to_string_lossy().to_string();
        let comments = if ext == "sh" || ext == "py" { hash_comments(&src) } else { c_comments(&src) };
        for (n, line) in comments.iter().enumerate() {
            bad.extend(history_refs(line).into_iter().map(|r| format!("{}:{} → {r}", rel(&root, &f), n + 1)));
        }
    }
    assert!(bad.is_empty(), "issue numbers in README, docs or code comments (history goes to CHANGELOG.md):\n{}", bad.join("\n"));
    assert_eq!(history_refs("Regression (issue 13, finding 8): x"), ["issue 13,", "finding 8):"]);
    assert!(history_refs("candle issue #3886 and 2 issues remain").is_empty());
}

/// A path component that names a development issue: `issue20`, `cpu-issue22-intel`, `issue_7`,
/// `Issue-3.json`. Folders are named by what they hold (device, topic, commit), never by history.
fn names_an_issue(component: &str) -> bool {
    let lower = component.to_ascii_lowercase();
    lower.match_indices("issue").any(|(i, _)| {
        let rest = lower[i + "issue".len()..].trim_start_matches(['-', '_']);
        rest.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// Every file and folder under `dir`, as paths relative to `root`.
fn tree(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        out.push(rel(root, &p));
        if p.is_dir() {
            tree(root, &p, out);
        }
    }
}

/// results/ and docs/ are what a reader opens: no path there is named after an issue, results/
/// holds records and no sources or patches (a build never compiles them), each folder of
/// results/ has a README.md saying how its files were made, and those READMEs carry no issue
/// numbers either.
#[test]
fn results_and_docs_paths_name_what_they_hold() {
    let root = root();
    let mut paths = Vec::new();
    for dir in ["results", "docs"] {
        tree(&root, &root.join(dir), &mut paths);
    }
    assert!(paths.iter().any(|p| p == "results/ladder-cpu.json"), "the recorded CPU run is found: {paths:?}");
    let bad: Vec<&String> = paths.iter().filter(|p| p.split('/').any(names_an_issue)).collect();
    assert!(bad.is_empty(), "paths under results/ or docs/ named after an issue (name them by device, topic or commit):\n{bad:?}");
    let sources: Vec<&String> = paths
        .iter()
        .filter(|p| p.starts_with("results/"))
        .filter(|p| [".rs", ".cu", ".patch", ".diff", ".py", ".cpp"].iter().any(|x| p.ends_with(x)))
        .collect();
    assert!(sources.is_empty(), "sources or patches under results/ (results hold what ran, not code):\n{sources:?}");
    let mut readmes = vec![root.join("results/README.md")];
    for e in std::fs::read_dir(root.join("results")).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            assert!(p.join("README.md").is_file(), "{} has no README.md saying how its files were made", rel(&root, &p));
            readmes.push(p.join("README.md"));
        }
    }
    let mut history = Vec::new();
    for readme in &readmes {
        for (n, line) in std::fs::read_to_string(readme).unwrap().lines().enumerate() {
            history.extend(history_refs(line).into_iter().map(|r| format!("{}:{} → {r}", rel(&root, readme), n + 1)));
        }
    }
    assert!(history.is_empty(), "issue numbers in results' READMEs (history goes to CHANGELOG.md):\n{}", history.join("\n"));
    assert!(names_an_issue("cpu-issue22-intel") && names_an_issue("Issue_7.json") && names_an_issue("issue-20"));
    assert!(!names_an_issue("issues") && !names_an_issue("h100-98cd396") && !names_an_issue("reissued"));
}
