//! Which content format a chat template expects, decided as vLLM decides it
//! (`vllm/renderers/hf.py`, `_detect_content_format` and `_iter_nodes_assign_content_item`): a
//! template that loops over a message's `content` (or over a macro parameter that is handed a
//! message's content, or over a variable named `content` outside macros) reads the content parts
//! itself ("openai": the parts reach it as `[{"type": "text", "text": ...}]`); any other template
//! gets each message's text parts joined with newlines ("string").
//!
//! vLLM walks Jinja2's syntax tree; this walks the template's block tags with a small scanner
//! that recognises the same shapes: `set X = messages...` aliases (slices, filters,
//! `namespace(k=messages)`, `ns.k = messages`), `for m in <messages alias>` loops, and `for x in
//! m.content` / `m['content']` loops (with filters or slices after them). What it cannot
//! recognise counts as "string", vLLM's own fallback.

use std::collections::HashSet;

/// How message content reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with `"\n"` into one string.
    String,
    /// A list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// One `{% ... %}` tag: its inner text (markers and spaces trimmed) and byte offset.
struct Tag<'a> {
    text: &'a str,
    offset: usize,
}

fn block_tags(source: &str) -> Vec<Tag<'_>> {
    let mut tags = Vec::new();
    let mut i = 0;
    while let Some(rel) = source[i..].find("{") {
        let start = i + rel;
        let rest = &source[start..];
        if rest.starts_with("{#") {
            match rest.find("#}") {
                Some(end) => i = start + end + 2,
                None => break,
            }
        } else if rest.starts_with("{%") {
            let Some(end) = find_tag_end(rest) else { break };
            let inner = rest[2..end]
                .trim_start_matches(['-', '+'])
                .trim_end_matches(['-', '+']);
            tags.push(Tag {
                text: inner.trim(),
                offset: start,
            });
            i = start + end + 2;
        } else {
            i = start + 1;
        }
    }
    tags
}

/// The offset of the `%}` closing a tag that starts at 0, skipping quoted strings.
fn find_tag_end(tag: &str) -> Option<usize> {
    let bytes = tag.as_bytes();
    let mut quote: Option<u8> = None;
    let mut i = 2;
    while i + 1 < bytes.len() {
        let b = bytes[i];
        match quote {
            Some(_) if b == b'\\' => i += 1,
            Some(q) if b == q => quote = None,
            Some(_) => {}
            None if b == b'\'' || b == b'"' => quote = Some(b),
            None if b == b'%' && bytes[i + 1] == b'}' => return Some(i),
            None => {}
        }
        i += 1;
    }
    None
}

/// Splits `s` at top-level occurrences of `sep` (outside brackets and quotes).
fn split_top(s: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// The top-level ` if ` of a `for` tag's filter, or a trailing ` recursive`, cut off.
fn strip_for_suffix(iter: &str) -> &str {
    let mut iter = iter.trim();
    if let Some(rest) = iter.strip_suffix("recursive") {
        iter = rest.trim_end();
    }
    // A top-level " if " that is not inside brackets or quotes starts the loop filter.
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    for (i, c) in iter.char_indices() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ' ' if depth == 0 && iter[i..].starts_with(" if ") => return iter[..i].trim(),
            _ => {}
        }
    }
    iter
}

/// The expression with its filters (`| f`), a trailing test (`is ...`) and trailing slice
/// subscripts (`[a:b]`) removed: what vLLM's `_is_var_or_elems_access` looks through.
fn access_core(expr: &str) -> &str {
    let mut core = split_top(expr, '|')[0].trim();
    if let Some(pos) = find_top_word(core, " is ") {
        core = core[..pos].trim();
    }
    while let Some(stripped) = core.strip_suffix(']') {
        let Some(open) = matching_open_bracket(stripped) else {
            break;
        };
        let inside = &stripped[open + 1..];
        if split_top(inside, ':').len() < 2 {
            break;
        }
        core = stripped[..open].trim_end();
    }
    core
}

fn find_top_word(s: &str, word: &str) -> Option<usize> {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    for (i, c) in s.char_indices() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            _ if depth == 0 && s[i..].starts_with(word) => return Some(i),
            _ => {}
        }
    }
    None
}

/// The index of the `[` that opens the bracket closed at the end of `s` (whose `]` was removed).
fn matching_open_bracket(s: &str) -> Option<usize> {
    let mut depth = 0i32;
    for (i, c) in s.char_indices().rev() {
        match c {
            ']' => depth += 1,
            '[' if depth == 0 => return Some(i),
            '[' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// Whether `expr` is `var` (or an element slice/filter of it).
fn accesses_var(expr: &str, var: &str) -> bool {
    access_core(expr) == var
}

/// Whether `expr` is `var.key`, `var['key']` or `var["key"]` (or a slice/filter of it).
fn accesses_key(expr: &str, var: &str, key: &str) -> bool {
    let core = access_core(expr);
    let Some(rest) = core.strip_prefix(var) else {
        return false;
    };
    let rest = rest.trim_start();
    if let Some(attr) = rest.strip_prefix('.') {
        return attr.trim() == key;
    }
    if let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        let inner = inner.trim();
        return inner == format!("'{key}'") || inner == format!("\"{key}\"");
    }
    false
}

struct ForLoop<'a> {
    target: &'a str,
    iter: &'a str,
    offset: usize,
}

fn parse_for<'a>(tag: &Tag<'a>) -> Option<ForLoop<'a>> {
    let rest = tag.text.strip_prefix("for ")?;
    let pos = find_top_word(rest, " in ")?;
    Some(ForLoop {
        target: rest[..pos].trim(),
        iter: strip_for_suffix(&rest[pos + 4..]),
        offset: tag.offset,
    })
}

struct Macro<'a> {
    name: &'a str,
    params: Vec<&'a str>,
    start: usize,
    end: usize,
}

fn parse_macros<'a>(tags: &[Tag<'a>]) -> Vec<Macro<'a>> {
    let mut macros = Vec::new();
    let mut open: Vec<(&'a str, Vec<&'a str>, usize)> = Vec::new();
    for tag in tags {
        if let Some(rest) = tag.text.strip_prefix("macro ") {
            let Some(paren) = rest.find('(') else {
                continue;
            };
            let name = rest[..paren].trim();
            let args = rest[paren + 1..].trim_end().trim_end_matches(')');
            let params = split_top(args, ',')
                .into_iter()
                .map(|p| split_top(p, '=')[0].trim())
                .filter(|p| !p.is_empty())
                .collect();
            open.push((name, params, tag.offset));
        } else if tag.text == "endmacro" || tag.text.starts_with("endmacro ") {
            if let Some((name, params, start)) = open.pop() {
                macros.push(Macro {
                    name,
                    params,
                    start,
                    end: tag.offset,
                });
            }
        }
    }
    macros
}

/// The arguments of every call `name(...)` in `source`.
fn call_args<'a>(source: &'a str, name: &str) -> Vec<Vec<&'a str>> {
    let mut calls = Vec::new();
    let mut from = 0;
    while let Some(rel) = source[from..].find(name) {
        let start = from + rel;
        from = start + name.len();
        let before_ok = source[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == '.'));
        let after = &source[from..];
        if !before_ok || !after.trim_start().starts_with('(') {
            continue;
        }
        let open = from + (after.len() - after.trim_start().len());
        let mut depth = 0i32;
        let mut quote: Option<char> = None;
        let mut close = None;
        for (i, c) in source[open..].char_indices() {
            if let Some(q) = quote {
                if c == q {
                    quote = None;
                }
                continue;
            }
            match c {
                '\'' | '"' => quote = Some(c),
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        if let Some(close) = close {
            calls.push(
                split_top(&source[open + 1..close], ',')
                    .into_iter()
                    .map(str::trim)
                    .collect(),
            );
        }
    }
    calls
}

/// Decides the content format of `source` (see the module header).
pub fn detect(source: &str) -> ContentFormat {
    let tags = block_tags(source);

    // Variables assigned from `messages` (and from those), with namespace aliases.
    let mut messages_vars: Vec<String> = vec!["messages".into()];
    let mut seen: HashSet<String> = messages_vars.iter().cloned().collect();
    let mut i = 0;
    while i < messages_vars.len() {
        let related = messages_vars[i].clone();
        i += 1;
        for tag in &tags {
            let Some(rest) = tag.text.strip_prefix("set ") else {
                continue;
            };
            let parts = split_top(rest, '=');
            if parts.len() != 2 {
                continue;
            }
            let (lhs, rhs) = (parts[0].trim(), parts[1].trim());
            let mut found: Vec<String> = Vec::new();
            if accesses_var(rhs, &related) {
                found.push(lhs.to_string());
            }
            if let Some(args) = rhs
                .strip_prefix("namespace(")
                .and_then(|r| r.strip_suffix(')'))
            {
                for kw in split_top(args, ',') {
                    let kv = split_top(kw, '=');
                    if kv.len() == 2 && accesses_var(kv[1].trim(), &related) {
                        found.push(format!("{lhs}.{}", kv[0].trim()));
                    }
                }
            }
            for name in found {
                if seen.insert(name.clone()) {
                    messages_vars.push(name);
                }
            }
        }
    }

    let loops: Vec<ForLoop<'_>> = tags.iter().filter_map(parse_for).collect();
    let message_vars: Vec<&str> = loops
        .iter()
        .filter(|l| messages_vars.iter().any(|v| accesses_var(l.iter, v)))
        .map(|l| l.target)
        .collect();
    if loops.iter().any(|l| {
        message_vars
            .iter()
            .any(|m| accesses_key(l.iter, m, "content"))
    }) {
        return ContentFormat::OpenAi;
    }

    let macros = parse_macros(&tags);
    for m in &macros {
        let mut content_params: HashSet<&str> = HashSet::new();
        for args in call_args(source, m.name) {
            for (idx, arg) in args.iter().enumerate() {
                let kv = split_top(arg, '=');
                let (param, value) = if kv.len() == 2 && !arg.contains("==") {
                    (Some(kv[0].trim()), kv[1].trim())
                } else {
                    (m.params.get(idx).copied(), *arg)
                };
                let Some(param) = param else { continue };
                if message_vars
                    .iter()
                    .any(|mv| accesses_key(value, mv, "content"))
                {
                    content_params.insert(param);
                }
            }
        }
        let inside = loops
            .iter()
            .filter(|l| l.offset > m.start && l.offset < m.end);
        for l in inside {
            if content_params.iter().any(|p| l.iter == *p) {
                return ContentFormat::OpenAi;
            }
        }
    }
    let in_macro = |offset: usize| macros.iter().any(|m| offset > m.start && offset < m.end);
    if loops
        .iter()
        .any(|l| l.iter == "content" && !in_macro(l.offset))
    {
        return ContentFormat::OpenAi;
    }
    ContentFormat::String
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(source: &str, expected: ContentFormat) {
        assert_eq!(detect(source), expected, "{source}");
    }

    #[test]
    fn formats() {
        use ContentFormat::*;
        check("{% for m in messages %}{{ m.content }}{% endfor %}", String);
        check(
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            OpenAi,
        );
        check("{%- for m in messages[1:] %}{%- for p in m['content'] | selectattr('type') %}{% endfor %}{% endfor %}", OpenAi);
        check("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m[\"content\"] %}{% endfor %}{% endfor %}", OpenAi);
        check("{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for c in m.content %}{% endfor %}{% endfor %}", OpenAi);
        check("{% for m in messages if m.role != 'system' %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}", String);
        check("{% macro r(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}", OpenAi);
        check("{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.role) }}{% endfor %}", String);
        check("{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}", OpenAi);
        check("{# {% for p in message.content %} #}{% for m in messages %}{{ m.content }}{% endfor %}", String);
        check(
            "{% for m in messages %}{{ '%}' }}{% for x in m.tool_calls %}{% endfor %}{% endfor %}",
            String,
        );
    }
}
