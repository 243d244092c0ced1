//! Every command the README shows is run by CI: each command in its `sh` blocks and each inline
//! `cargo …`/`docker …` span must appear in .ci/run (possibly with extra flags, e.g. CI adds
//! `--preset tiny` to keep a run short), unless it is listed below as one CI cannot run, with
//! the reason. A README command nobody runs is how tutorials rot.

use std::path::Path;

#[path = "support/cite.rs"]
mod cite;
#[path = "support/prose.rs"]
mod prose;

/// Commands CI cannot run on its GPU-less, Docker-less machine: which, and what covers them.
struct NotRunByCi {
    rule: &'static str,
    applies: fn(&[String]) -> bool,
    instead: &'static str,
}

const NOT_RUN_BY_CI: &[NotRunByCi] = &[
    NotRunByCi {
        rule: "cargo run/test/bench with a cuda feature",
        applies: |w| {
            w.first().is_some_and(|c| c == "cargo")
                && w.get(1).is_some_and(|c| ["run", "test", "bench"].contains(&c.as_str()))
                && w.windows(2).any(|p| p[0] == "--features" && p[1].split(',').any(|f| f == "cuda" || f == "flash-attn"))
        },
        instead:
            "needs an NVIDIA GPU to run; CI links ladder with --features cuda (scripts/gpu-bundle.sh) and runs clippy --all-targets with it",
    },
    NotRunByCi {
        rule: "docker build / docker run",
        applies: |w| w.first().is_some_and(|c| c == "docker"),
        instead: "needs Docker (and a GPU to run); CI lints the Dockerfile with hadolint",
    },
];

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The words of a command: without a trailing comment, leading `VAR=value` assignments, and
/// the subshell and `cd` scaffolding CI uses to run a command in a scratch folder.
fn words(cmd: &str) -> Vec<String> {
    let cmd = cmd.split(" #").next().unwrap_or("");
    let mut w: Vec<String> =
        cmd.split_whitespace().map(|w| w.trim_matches(|c| c == '(' || c == ')').to_string()).filter(|w| !w.is_empty()).collect();
    while w.first().is_some_and(|t| t.contains('=') && !t.starts_with('-')) {
        w.remove(0);
    }
    w
}

/// `needle` appears in `hay` in order, other words allowed in between.
fn subsequence(needle: &[String], hay: &[String]) -> bool {
    let mut it = hay.iter();
    needle.iter().all(|n| it.any(|h| h == n))
}

/// The commands the README shows: lines of its `sh` blocks (split at `&&`) and inline code
/// spans that start with `cargo ` or `docker ` (templates with `…` or `[flag]` excluded).
fn readme_commands(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in readme.lines() {
        if line.trim_start().starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if in_sh {
            let line = line.trim();
            if let Some(cont) = line.strip_suffix('\\') {
                pending.push_str(cont);
                pending.push(' ');
                continue;
            }
            pending.push_str(line);
            for part in pending.split("&&") {
                if !words(part).is_empty() {
                    out.push(part.trim().to_string());
                }
            }
            pending.clear();
            continue;
        }
        for (i, span) in line.split('`').enumerate() {
            let is_code = i % 2 == 1;
            if is_code && (span.starts_with("cargo ") || span.starts_with("docker ")) && !span.contains('…') && !span.contains('[') {
                out.push(span.to_string());
            }
        }
    }
    out
}

/// .ci/run as commands: continuation lines joined, split at `&&` and `;`.
fn ci_commands(ci: &str) -> Vec<Vec<String>> {
    ci.replace("\\\n", " ")
        .lines()
        .flat_map(|l| l.split("&&").flat_map(|p| p.split(';')).map(words).collect::<Vec<_>>())
        .filter(|w| !w.is_empty())
        .collect()
}

#[test]
fn every_readme_command_is_run_by_ci() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let ci = ci_commands(&std::fs::read_to_string(root().join(".ci/run")).unwrap());
    let commands = readme_commands(&readme);
    assert!(commands.iter().any(|c| words(c) == words("cargo run --release -p ladder")), "the quick start is found: {commands:?}");
    let mut missing = Vec::new();
    for cmd in &commands {
        let w = words(cmd);
        let exempt = NOT_RUN_BY_CI.iter().any(|e| (e.applies)(&w));
        if !exempt && !ci.iter().any(|line| subsequence(&w, line)) {
            missing.push(cmd.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "README commands that .ci/run never runs (add them to .ci/run, or to NOT_RUN_BY_CI with the reason):\n{}",
        missing.join("\n")
    );
    // No stale exemptions: each still covers a README command.
    for e in NOT_RUN_BY_CI {
        assert!(commands.iter().any(|c| (e.applies)(&words(c))), "exemption \"{}\" ({}) covers no README command", e.rule, e.instead);
    }
}

#[test]
fn command_matching() {
    let ci = ci_commands("set -e\n(cd target/ci && SPEEDKIT_PRESET=tiny cargo run --release --manifest-path ../../Cargo.toml -p ladder -- --update-readme)\ncargo check --workspace \\\n  --all-targets --features cuda # compile only\n");
    let w = |s: &str| words(s);
    assert!(ci.iter().any(|l| subsequence(&w("cargo run --release -p ladder -- --update-readme"), l)), "{ci:?}");
    assert!(ci.iter().any(|l| subsequence(&w("cargo check --workspace --features cuda"), l)), "{ci:?}");
    assert!(!ci.iter().any(|l| subsequence(&w("cargo run --release -p ladder -- --sweep seq=8"), l)));
    let gpu = |c: &str| NOT_RUN_BY_CI.iter().any(|e| (e.applies)(&w(c)));
    assert!(gpu("cargo run --release --features cuda -p ladder -- --device cuda"));
    assert!(gpu("cargo bench -p stage2_sdpa --features cuda,flash-attn") && gpu("docker run --rm x"));
    assert!(!gpu("cargo check --workspace --features cuda") && !gpu("cargo run --release -p ladder"));
    let readme = "text `cargo bench -p x` and `cargo run -- [flag] …`\n```sh\nsource a.sh && cargo check # why\ncargo run \\\n  -p ladder\n```\n```\nnot sh\n```\n";
    assert_eq!(readme_commands(readme), ["cargo bench -p x", "source a.sh", "cargo check # why", "cargo run  -p ladder"]);
}

/// README.md and every docs/*.md page: the prose the citation tests read.
fn pages() -> Vec<std::path::PathBuf> {
    let mut pages = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    pages
}

/// Every number README.md and docs/*.md cite from a recorded run (`cite`) is what that JSON
/// holds, and the README's stage sections cite at least one each. With
/// `SPEEDKIT_BLESS_CITATIONS=1` stale citations are rewritten from their JSONs instead (run it
/// once after re-recording a run).
#[test]
fn every_cited_number_is_in_the_json_it_names() {
    let bless = std::env::var("SPEEDKIT_BLESS_CITATIONS").is_ok_and(|v| v == "1");
    let mut total = 0;
    for doc in &pages() {
        let mut text = std::fs::read_to_string(doc).unwrap();
        let dir = doc.parent().unwrap().to_path_buf();
        let load = |link: &str| -> Result<serde_json::Value, String> {
            let bytes = std::fs::read(dir.join(link)).map_err(|e| format!("{link}: {e}"))?;
            serde_json::from_slice(&bytes).map_err(|e| format!("{link}: {e}"))
        };
        let cites = cite::find(&text);
        total += cites.len();
        if bless {
            let mut links: Vec<String> = cites.into_iter().map(|c| c.json).collect();
            links.sort();
            links.dedup();
            let before = text.clone();
            for link in &links {
                let Ok(json) = load(link) else { continue };
                text = cite::update(&text, link, &json).0;
            }
            if text != before {
                shared::output::write("SPEEDKIT_BLESS_CITATIONS", doc, text.as_bytes()).unwrap();
                println!("blessed {}", doc.display());
            }
        }
        let bad = prose::check(&text, load);
        let report: Vec<String> = bad.iter().map(|(c, why)| format!("[{}]({} \"{}\"): {why}", c.text, c.json, c.path)).collect();
        assert!(
            report.is_empty(),
            "{}: citations that do not match their JSON (SPEEDKIT_BLESS_CITATIONS=1 rewrites them from it):\n{}",
            doc.display(),
            report.join("\n")
        );
    }
    assert!(total > 0, "no citations found: the README's numbers should link to their JSON");
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for section in readme.split("\n### ").skip(1).filter(|s| s.starts_with("Stage ")) {
        assert!(!cite::find(section).is_empty(), "README's \"{}\" cites no measured number", section.lines().next().unwrap());
    }
}

/// Prose states no measured number without its source: every time, rate, ratio, size or error in
/// README.md and docs/*.md is a citation of a recorded JSON (checked above) or a link to the file
/// it comes from (a profiler excerpt, a GPU run's notes, a datasheet). Targets are written with ≥
/// or ≤, constants and limits as code (`256 MiB`).
#[test]
fn no_measured_number_in_prose_goes_without_its_source() {
    let pages = pages();
    assert!(pages.len() > 5, "README and the docs pages: {pages:?}");
    let mut bad = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (line, n) in prose::bare_numbers(&text) {
            bad.push(format!("{}:{line}: {n}", page.strip_prefix(root()).unwrap_or(page).display()));
        }
    }
    assert!(bad.is_empty(), "measured numbers without a citation or a source link (see ladder/tests/support/cite.rs):\n{}", bad.join("\n"));
}

/// Most lines README.md may hold: what the project is, the two commands, the results tables and a
/// note per stage. Detail goes to a docs page, and a rendered region with it (`render::DOCS_REGIONS`).
const README_MAX_LINES: usize = 200;

#[test]
fn the_readme_stays_short_and_keeps_its_sections() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail to a docs page (a rendered region with it, see ladder::render::DOCS_REGIONS)"
    );
    for heading in ["## Quick start", "## The five steps", "## Results", "## Training", "## Use a technique in your own model"] {
        assert!(readme.lines().any(|l| l == heading), "README.md has no \"{heading}\" section");
    }
    // Each region the README holds shows a run's table, its detail on the docs page it links.
    for (summary, full) in ladder::render::SUMMARY_REGIONS {
        let (begin, _) = ladder::render::markers(summary);
        assert!(readme.contains(&begin), "README.md has no {summary} region");
        let page = ladder::render::region_page(&root().join("README.md"), full).0;
        let text = std::fs::read_to_string(&page).unwrap();
        assert!(text.contains(&ladder::render::markers(full).0), "{} has no {full} region", page.display());
    }
}
