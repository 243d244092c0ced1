//! Numbers in prose, tied to the recorded run they come from.
//!
//! A number in README (or docs/) prose is written as a link to the JSON with the value's path
//! as the link title, e.g.
//!
//! ```text
//! fusion buys [1.44x](results/ladder-cpu.json "records[stage=stage3_fused].speedup_vs_prev") over stage 2
//! ```
//!
//! `ladder/tests/readme.rs` checks each is what the JSON holds at that path, and that prose holds no
//! measured number without its source; with `SPEEDKIT_BLESS_CITATIONS=1` it rewrites stale ones (`update`).
//!
//! Path: dot-separated keys; `name[key=value]` picks the element of an array whose `key` is
//! `value`; `name[3]` by index. The unit is the text's suffix: `x` (ratio, 2 decimals), `ms`
//! (`shared::report::fmt_ms`), `MiB` (bytes shown in MiB, 1 decimal), `GiB` (2 decimals), `%`
//! (1 decimal), `TFLOP/s` (no decimals), `e` notation (e.g. `1.8e-2`, 1 decimal), or none (as the
//! JSON's integer).

use regex::Regex;
use serde_json::Value;
use std::sync::LazyLock;

/// `[text](target)`: the text on one line without a `[`, the target up to the first `)`.
static LINK: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\[([^\[\n]*?)\]\(([^)]*)\)").unwrap());
/// A fenced code block, ``` line to ``` line: examples there are not citations.
static FENCE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(?ms)^[ \t]*```.*?^[ \t]*```[^\n]*\n?").unwrap());

/// One cited number: where it is in the text, what it says, and what it points at.
#[derive(Clone, Debug, PartialEq)]
pub struct Citation {
    /// Byte range of the link text (the number) in the document.
    pub text_at: std::ops::Range<usize>,
    pub text: String,
    pub json: String,
    pub path: String,
}

/// Every `[text](results/*.json "path")` link in `doc`, outside fenced code blocks.
pub fn find(doc: &str) -> Vec<Citation> {
    let fenced: Vec<_> = FENCE.find_iter(doc).map(|m| m.range()).collect();
    let (mut out, mut from) = (Vec::new(), 0);
    while let Some(link) = LINK.captures_at(doc, from) {
        let (all, text) = (link.get(0).unwrap(), link.get(1).unwrap());
        from = all.start() + 1;
        if let Some(f) = fenced.iter().find(|f| f.contains(&all.start())) {
            from = f.end;
            continue;
        }
        let Some((file, title)) = link[2].split_once(" \"") else { continue };
        let Some(path) = title.strip_suffix('"') else { continue };
        if file.ends_with(".json") && file.contains("results/") {
            out.push(Citation { text_at: text.range(), text: text.as_str().into(), json: file.into(), path: path.into() });
            from = all.end();
        }
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
    Ok(match () {
        _ if t.ends_with('x') => format!("{v:.2}x"),
        _ if t.ends_with(" ms") => format!("{} ms", shared::report::fmt_ms(v)),
        _ if t.ends_with(" MiB") => format!("{:.1} MiB", v / (1u64 << 20) as f64),
        _ if t.ends_with(" GiB") => format!("{:.2} GiB", v / (1u64 << 30) as f64),
        _ if t.ends_with('%') => format!("{v:.1}%"),
        _ if t.ends_with(" TFLOP/s") => format!("{v:.0} TFLOP/s"),
        _ if t.contains('e') => format!("{v:.1e}"),
        _ => format!("{v}"),
    })
}

/// What the JSON says the citation should read, or why it cannot be resolved.
pub fn expected(c: &Citation, json: &Value) -> Result<String, String> {
    format_like(&c.text, lookup(json, &c.path)?)
}

/// `doc` with every citation of `json_link` rewritten from `json`; one `json` lacks is kept and named.
pub fn update(doc: &str, json_link: &str, json: &Value) -> (String, Vec<String>) {
    let (mut out, mut last, mut stale) = (String::with_capacity(doc.len()), 0, Vec::new());
    for c in find(doc).into_iter().filter(|c| c.json == json_link) {
        match expected(&c, json) {
            Ok(want) => {
                out += &doc[last..c.text_at.start];
                out += &want;
                last = c.text_at.end;
            }
            Err(e) => stale.push(format!("[{}]({} \"{}\"): {e}", c.text, c.json, c.path)),
        }
    }
    (out + &doc[last..], stale)
}
