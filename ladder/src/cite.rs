//! Numbers in prose, tied to the recorded run they come from.
//!
//! A number in README (or docs/) prose is written as a link to the JSON with the value's path
//! as the link title, e.g.
//!
//! ```text
//! fusion buys [1.44x](results/ladder-cpu.json "records[stage=stage3_fused].speedup_vs_prev") over stage 2
//! ```
//!
//! It renders as the number, linked to the data. `check` verifies every such number is what the
//! JSON holds at that path (a test runs it on README.md and docs/*.md); `update` rewrites them
//! from the JSON, so re-recording a run updates the prose mechanically (`ladder --update-readme`
//! and `ladder render --update-readme` do it for the JSON they write or read).
//!
//! Path: dot-separated keys; `name[key=value]` picks the element of an array whose `key` is
//! `value`; `name[3]` by index. The unit is the text's suffix: `x` (ratio, 2 decimals), `ms`
//! (`render::fmt_ms`), `MiB` (bytes shown in MiB, 1 decimal), `GiB` (2 decimals), `%`
//! (1 decimal), `e` notation (e.g. `1.8e-2`, 1 decimal), or none (as the JSON's integer).

use serde_json::Value;

/// One cited number: where it is in the text, what it says, and what it points at.
#[derive(Clone, Debug, PartialEq)]
pub struct Citation {
    /// Byte range of the link text (the number) in the document.
    pub text_at: std::ops::Range<usize>,
    pub text: String,
    pub json: String,
    pub path: String,
}

/// Byte ranges of fenced code blocks (``` lines): examples there are not citations.
fn fences(doc: &str) -> Vec<std::ops::Range<usize>> {
    let (mut out, mut start, mut at) = (Vec::new(), None, 0);
    for line in doc.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            match start.take() {
                None => start = Some(at),
                Some(s) => out.push(s..at + line.len()),
            }
        }
        at += line.len();
    }
    out
}

/// Every `[text](results/*.json "path")` link in `doc`, outside fenced code blocks.
pub fn find(doc: &str) -> Vec<Citation> {
    let mut out = Vec::new();
    let fenced = fences(doc);
    let mut from = 0;
    while let Some(open) = doc[from..].find('[').map(|i| i + from) {
        from = open + 1;
        if let Some(f) = fenced.iter().find(|f| f.contains(&open)) {
            from = f.end;
            continue;
        }
        let Some(close) = doc[open..].find("](").map(|i| i + open) else { break };
        let text = &doc[open + 1..close];
        if text.contains('[') || text.contains('\n') {
            continue;
        }
        let target_start = close + 2;
        let Some(end) = doc[target_start..].find(')').map(|i| i + target_start) else { break };
        let target = &doc[target_start..end];
        let Some((file, title)) = target.split_once(" \"") else { continue };
        let Some(path) = title.strip_suffix('"') else { continue };
        if !(file.ends_with(".json") && file.contains("results/")) {
            continue;
        }
        out.push(Citation { text_at: open + 1..close, text: text.to_string(), json: file.to_string(), path: path.to_string() });
        from = end;
    }
    out
}

/// Units that mark a number as a measurement (a time, a rate, a ratio, a size, an error).
const MEASURED_UNITS: [&str; 14] = ["ms", "µs", "s", "x", "GFLOP/s", "TFLOP/s", "GB/s", "TB/s", "%", "MiB", "GiB", "MB", "GB", "KB"];

/// Measured-looking numbers in `doc`'s prose that are not citations: a number followed by a
/// unit of `MEASURED_UNITS`, or one in e-notation with a decimal (an error like `2.8e-2`; a
/// tolerance such as `1e-2` is a constant), outside fenced and
/// inline code, links (a citation, or a link to the file it comes from), HTML comments, and
/// the generated regions between `<!-- NAME:begin -->` and `<!-- NAME:end -->`. A target or bound
/// written with ≥, ≤, < or > before it is not a measurement, nor is the noise label ≈1.0x.
/// Returns (line number, the text).
pub fn bare_numbers(doc: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let (mut fenced, mut generated) = (false, false);
    for (i, line) in doc.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if t.starts_with("<!--") && t.contains(":begin") {
            generated = true;
        }
        if t.starts_with("<!--") && t.contains(":end") {
            generated = false;
            continue;
        }
        if fenced || generated {
            continue;
        }
        for n in numbers_in(&prose_only(line)) {
            out.push((i + 1, n));
        }
    }
    out
}

/// `line` with inline code, links' text and targets, and HTML comments blanked out.
fn prose_only(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        let skip_to =
            |from: &str, open: &str, close: &str| from.strip_prefix(open).and_then(|r| r.find(close).map(|e| open.len() + e + close.len()));
        let skip = match c {
            '`' => skip_to(rest, "`", "`"),
            '<' => skip_to(rest, "<!--", "-->"),
            '[' => rest.find("](").filter(|&m| !rest[1..m].contains('[')).and_then(|m| rest[m..].find(')').map(|e| m + e + 1)),
            _ => None,
        };
        match skip {
            Some(n) => {
                out.push(' ');
                rest = &rest[n..];
            }
            None => {
                out.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    out
}

/// The measured-looking numbers of a prose line (see `bare_numbers`).
fn numbers_in(prose: &str) -> Vec<String> {
    let chars: Vec<char> = prose.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit() && (i == 0 || !(chars[i - 1].is_alphanumeric() || "._-/".contains(chars[i - 1])));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && (chars[j].is_ascii_digit() || (chars[j] == '.' && chars.get(j + 1).is_some_and(|c| c.is_ascii_digit()))) {
            j += 1;
        }
        let mut number: String = chars[i..j].iter().collect();
        let mut e_notation = false;
        if chars.get(j) == Some(&'e') && chars.get(j + 1).is_some_and(|c| *c == '-' || c.is_ascii_digit()) {
            let mut k = j + 1 + usize::from(chars[j + 1] == '-');
            while k < chars.len() && chars[k].is_ascii_digit() {
                k += 1;
            }
            // A measured error prints with a decimal (1.8e-2, as `fmt_rel_err` writes it); a
            // tolerance or bound is a round power (1e-2) and is a constant, not a measurement.
            e_notation = number.contains('.') && k > j + 1;
            number = chars[i..k].iter().collect();
            j = k;
        }
        // The unit: right after the number or after one space, ending at a word boundary.
        let after: String = chars[j..].iter().collect();
        let unit = after.strip_prefix(' ').unwrap_or(&after);
        let has_unit = MEASURED_UNITS
            .iter()
            .any(|u| unit.starts_with(u) && !unit[u.len()..].chars().next().is_some_and(|c| c.is_alphanumeric() || c == '/'));
        let before: String = chars[..i].iter().rev().take(3).collect::<String>().chars().rev().collect();
        // ≥ ≤ < > mark a target or bound; ≈ marks the noise label (`≈1.0x`), not a value.
        let bound = ["≥", "≤", "<", ">", "≈"].iter().any(|b| before.trim_end().ends_with(b));
        if (has_unit || e_notation) && !bound {
            out.push(number);
        }
        i = j.max(i + 1);
    }
    out
}

/// The value at `path` in `v`.
pub fn lookup<'a>(v: &'a Value, path: &str) -> Result<&'a Value, String> {
    let mut cur = v;
    for step in path.split('.') {
        let (key, select) = match step.split_once('[') {
            Some((k, rest)) => (k, Some(rest.strip_suffix(']').ok_or_else(|| format!("'{step}': unclosed ["))?)),
            None => (step, None),
        };
        if !key.is_empty() {
            cur = cur.get(key).ok_or_else(|| format!("no '{key}' in {path}"))?;
        }
        if let Some(sel) = select {
            let arr = cur.as_array().ok_or_else(|| format!("'{key}' is not an array in {path}"))?;
            cur = match sel.split_once('=') {
                Some((k, want)) => arr
                    .iter()
                    .find(|e| e.get(k).and_then(|x| x.as_str()) == Some(want))
                    .ok_or_else(|| format!("no element of '{key}' with {k} = {want}"))?,
                None => {
                    let i: usize = sel.parse().map_err(|_| format!("'{sel}' is not an index or key=value"))?;
                    arr.get(i).ok_or_else(|| format!("'{key}' has no element {i}"))?
                }
            };
        }
    }
    Ok(cur)
}

/// `value` written in the unit `like` is written in (see the module notes).
pub fn format_like(like: &str, value: &Value) -> Result<String, String> {
    let v = value.as_f64().ok_or_else(|| format!("{value} is not a number"))?;
    let t = like.trim();
    Ok(if t.ends_with('x') {
        format!("{v:.2}x")
    } else if t.ends_with(" ms") {
        format!("{} ms", crate::render::fmt_ms(v))
    } else if t.ends_with(" MiB") {
        format!("{:.1} MiB", v / (1u64 << 20) as f64)
    } else if t.ends_with(" GiB") {
        format!("{:.2} GiB", v / (1u64 << 30) as f64)
    } else if t.ends_with('%') {
        format!("{v:.1}%")
    } else if t.contains('e') {
        format!("{v:.1e}")
    } else {
        format!("{v}")
    })
}

/// What the JSON says the citation should read, or why it cannot be resolved.
pub fn expected(c: &Citation, json: &Value) -> Result<String, String> {
    format_like(&c.text, lookup(json, &c.path)?)
}

/// The citations in `doc` whose text is not what their JSON holds: (citation, what it should read
/// or why it cannot be checked). `load` reads a JSON by the link's target.
pub fn check(doc: &str, mut load: impl FnMut(&str) -> Result<Value, String>) -> Vec<(Citation, String)> {
    let mut bad = Vec::new();
    for c in find(doc) {
        match load(&c.json).and_then(|j| expected(&c, &j)) {
            Ok(want) if want == c.text => {}
            Ok(want) => bad.push((c, format!("should read {want}"))),
            Err(e) => bad.push((c, e)),
        }
    }
    bad
}

/// `doc` with every citation of `json_link` rewritten from `json`; citations of other files kept.
/// A citation whose path this JSON lacks (e.g. an ablation row, in a run without `--ablate`) is
/// kept as it was and named in the second value, for the caller to warn about.
pub fn update(doc: &str, json_link: &str, json: &Value) -> (String, Vec<String>) {
    let mut out = String::with_capacity(doc.len());
    let (mut last, mut stale) = (0, Vec::new());
    for c in find(doc).into_iter().filter(|c| c.json == json_link) {
        match expected(&c, json) {
            Ok(want) => {
                out.push_str(&doc[last..c.text_at.start]);
                out.push_str(&want);
                last = c.text_at.end;
            }
            Err(e) => stale.push(format!("[{}]({} \"{}\"): {e}", c.text, c.json, c.path)),
        }
    }
    out.push_str(&doc[last..]);
    (out, stale)
}

#[cfg(test)]
mod tests {
    #[test]
    fn bare_measured_numbers_are_found_and_cited_ones_are_not() {
        let doc = "Stage 3 takes 300 ms and buys 1.31x; [93.0 ms](results/a.json \"x\") is cited.\n\
                   Error 2.8e-2 at te (tolerance 1e-2), 58.8% of the ceiling, 12 GB/s.\n\
                   Targets: ≥ 80 % and ≥ 1.4x, within noise ≈1.0x. d_head 64, sm_90, 16 bytes, 2 cores, step 3, h100-98cd396.\n\
                   `cargo run -- --iters 10` and <!-- 5 ms --> are not prose.\n\
                   ```\n12 ms in a code block\n```\n\
                   <!-- results:begin -->\n| 550 ms |\n<!-- results:end -->\n\
                   After: 1.2x.";
        let found: Vec<(usize, String)> = bare_numbers(doc);
        let want: Vec<(usize, String)> = [(1, "300"), (1, "1.31"), (2, "2.8e-2"), (2, "58.8"), (2, "12"), (11, "1.2")]
            .iter()
            .map(|(l, n)| (*l, n.to_string()))
            .collect();
        assert_eq!(found, want);
    }

    use super::*;

    fn json() -> Value {
        serde_json::json!({
            "records": [
                {"stage": "stage0_baseline", "timing": {"median_ms": 445.12}, "peak_mem_bytes": 290766438u64},
                {"stage": "stage3_fused", "speedup_vs_prev": 1.4432, "check": {"rel_err": 0.0182}}
            ]
        })
    }

    #[test]
    fn finds_checks_and_updates_citations() {
        let doc = "Fusion buys [1.44x](results/a.json \"records[stage=stage3_fused].speedup_vs_prev\"), \
                   stage 0 takes [440 ms](results/a.json \"records[0].timing.median_ms\") and \
                   [277.3 MiB](results/a.json \"records[stage=stage0_baseline].peak_mem_bytes\"); error \
                   [1.8e-2](results/a.json \"records[1].check.rel_err\"). A [plain link](results/a.json) is not a citation.";
        let cites = find(doc);
        assert_eq!(cites.len(), 4);
        let fenced = format!("```text\n{doc}\n```\n");
        assert!(find(&fenced).is_empty(), "an example in a code block is not a citation");
        assert_eq!(cites[0].text, "1.44x");
        let j = json();
        let bad = check(doc, |_| Ok(j.clone()));
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert_eq!(bad[0].0.text, "440 ms");
        assert_eq!(bad[0].1, "should read 445 ms");
        let (fixed, stale) = update(doc, "results/a.json", &j);
        assert!(stale.is_empty(), "{stale:?}");
        assert!(check(&fixed, |_| Ok(j.clone())).is_empty());
        assert!(fixed.contains("[445 ms](results/a.json"), "{fixed}");
        // Another file's citations are left alone.
        assert_eq!(update(doc, "results/b.json", &j).0, doc);
    }

    #[test]
    fn a_path_that_does_not_resolve_is_reported() {
        let doc = "[1.00x](results/a.json \"records[stage=stage9].speedup_vs_prev\")";
        let bad = check(doc, |_| Ok(json()));
        assert!(bad[0].1.contains("stage9"), "{bad:?}");
        // Updating keeps it, and says so.
        let (kept, stale) = update(doc, "results/a.json", &json());
        assert_eq!((kept.as_str(), stale.len()), (doc, 1));
    }
}
