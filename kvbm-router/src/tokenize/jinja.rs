//! The chat-template environment: minijinja set up to render a Hugging Face chat template as
//! transformers' Jinja2 environment does (`transformers/utils/chat_template_utils.py`,
//! `_cached_compile_jinja_template`), plus the template-source analyses vLLM runs on it.
//!
//! What it mirrors, each a deliberate choice:
//! - `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off (Jinja2's default: one
//!   trailing newline of the template source is dropped), no auto-escaping.
//! - Globals `raise_exception(message)` (fails the render with that message) and
//!   `strftime_now(format)` (the time now, formatted; UTC, see [`strftime`]). `namespace`, `dict`,
//!   `range` and the loop controls are minijinja's own.
//! - `tojson` is Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, transformers' override: no HTML escaping, `", "`/`": "` separators,
//!   Python's float repr, arguments by position in that order or by name.
//! - Printing a value (`{{ x }}`), the `string` and `join` filters use Python's `str()`:
//!   `True`/`False`/`None`, floats as Python writes them, lists and dicts as Python's repr.
//! - `trim`, and the string methods `strip`/`lstrip`/`rstrip`/`split` without arguments, use
//!   Python's whitespace (`str.isspace`, which includes U+001C..U+001F); the other Python
//!   methods come from minijinja-contrib's pycompat.
//! - The tests `sequence` and `iterable` answer as Jinja2's do (a string and a dict are
//!   sequences; an undefined value is both).
//! - The `{% generation %}` block of transformers' `AssistantTracker` extension renders its body
//!   unchanged (the tracker is only active for `return_assistant_tokens_mask`, which vLLM never
//!   asks for); it is rewritten to a plain `{% if true %}` block before compiling, which keeps the
//!   block tag's whitespace control.
//!
//! Known differences that remain (none is exercised by the fixtures; each would need a template
//! that relies on it): `~` concatenation formats booleans and none as minijinja does (`true`,
//! `none`), not as Python (`True`, `None`); a `{% set %}` inside a `{% generation %}` block is
//! visible after it (in Jinja2 the block body is a macro with its own scope); Python's
//! `str.isprintable` is approximated when a string is written inside a printed list or dict.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

/// The deepest a value `tojson` or the Python formatter walks (JSON bodies are far shallower).
const VALUE_DEPTH_MAX: usize = 256;

/// The environment every chat template of a model is compiled in.
pub(super) fn environment(fuel: u64) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Lenient);
    env.set_fuel(Some(fuel));
    env.set_formatter(|out, _state, value| {
        if value.is_undefined() {
            return Ok(());
        }
        let mut text = String::new();
        py_str(value, &mut text, 0)?;
        out.write_str(&text)
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
    });
    env.set_unknown_method_callback(unknown_method);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("string", string_filter);
    env.add_filter("join", join_filter);
    env.add_filter("trim", trim_filter);
    env.add_test("sequence", is_sequence);
    env.add_test("iterable", is_iterable);
    Ok(env)
}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let mut text = String::new();
    py_str(&message, &mut text, 0)?;
    Err(Error::new(ErrorKind::InvalidOperation, text))
}

/// The longest format `strftime_now` takes: templates print a date (`"%d %b %Y"`); a format
/// built by the template itself could otherwise be as long as its fuel allows, and its output
/// several times that.
pub const STRFTIME_FORMAT_BYTES_MAX: usize = 256;
/// The longest text `strftime_now` writes (the longest directive, `%A`, writes 9 bytes for 2).
const STRFTIME_OUTPUT_BYTES_MAX: usize = 8 * STRFTIME_FORMAT_BYTES_MAX;

fn strftime_now(format: &str) -> Result<String, Error> {
    if format.len() > STRFTIME_FORMAT_BYTES_MAX {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "strftime_now: a format of {} bytes; at most {STRFTIME_FORMAT_BYTES_MAX} are accepted",
                format.len()
            ),
        ));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let text = strftime(format, now);
    if text.len() > STRFTIME_OUTPUT_BYTES_MAX {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: the date would take {} bytes; at most {STRFTIME_OUTPUT_BYTES_MAX} are written", text.len()),
        ));
    }
    Ok(text)
}

/// Formats `unix_secs` (UTC) with the C `strftime` directives templates use: `%Y %y %m %d %e %j
/// %H %I %M %S %p %a %A %b %B %F %T %D %%`, with glibc's `%-d` (no padding). Python's
/// `datetime.now()` is local time; the router and its workers normally run in UTC, and the
/// day-granular formats templates print (Llama 3.1's `"%d %b %Y"`) then agree.
pub(super) fn strftime(format: &str, unix_secs: i64) -> String {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3).
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:2}");
            }
            Some('j') => num(&mut out, yday, 3),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, (hour + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('D') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's method).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python's `str.isspace` for one character.
pub(super) fn is_py_space(c: char) -> bool {
    matches!(c, '\u{1c}'..='\u{1f}') || c.is_whitespace()
}

fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    out.to_string()
}

/// Python's `str.strip()` (whitespace as `str.isspace`).
pub(super) fn py_trim(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let no_chars = args.is_empty() || (args.len() == 1 && args[0].is_none());
        match method {
            "strip" | "lstrip" | "rstrip" if no_chars => {
                let left = method != "rstrip";
                let right = method != "lstrip";
                return Ok(Value::from(py_strip(s, None, left, right)));
            }
            "split" if no_chars => {
                let parts: Vec<Value> = s
                    .split(is_py_space)
                    .filter(|p| !p.is_empty())
                    .map(Value::from)
                    .collect();
                return Ok(Value::from(parts));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
}

fn is_iterable(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
        )
}

fn trim_filter(value: Value, chars: Option<Value>) -> Result<String, Error> {
    let mut text = String::new();
    py_str(&value, &mut text, 0)?;
    let chars = chars.filter(|c| !c.is_none() && !c.is_undefined());
    Ok(match chars {
        Some(c) => py_strip(&text, Some(c.as_str().unwrap_or("")), true, true),
        None => py_trim(&text).to_string(),
    })
}

fn string_filter(value: Value) -> Result<String, Error> {
    let mut text = String::new();
    py_str(&value, &mut text, 0)?;
    Ok(text)
}

/// Jinja2's `join(value, d="", attribute=None)`, each item through Python's `str()`.
fn join_filter(
    state: &State,
    value: Value,
    sep: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let sep = match sep.or(kwargs.get::<Option<Value>>("d")?) {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let mut text = String::new();
            py_str(&s, &mut text, 0)?;
            text
        }
        _ => String::new(),
    };
    let attribute: Option<Value> = kwargs.get("attribute")?;
    kwargs.assert_all_used()?;
    if value.is_undefined() || value.is_none() {
        return Ok(String::new());
    }
    let mut out = String::new();
    let items: Vec<Value> = if let Some(s) = value.as_str() {
        s.chars().map(Value::from).collect()
    } else {
        value.try_iter()?.collect()
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&sep);
        }
        let item = match &attribute {
            Some(attr) => attr_path(item, attr)?,
            None => item.clone(),
        };
        py_str(&item, &mut out, 0)?;
        state.consume_fuel(1)?;
    }
    Ok(out)
}

/// Jinja2's attribute getter: `"a.b"` walks keys, a part of digits is an index.
fn attr_path(item: &Value, attr: &Value) -> Result<Value, Error> {
    if let Some(path) = attr.as_str() {
        let mut cur = item.clone();
        for part in path.split('.') {
            cur = match part.parse::<i64>() {
                Ok(idx) => cur.get_item(&Value::from(idx))?,
                Err(_) => cur.get_item(&Value::from(part))?,
            };
        }
        Ok(cur)
    } else {
        item.get_item(attr)
    }
}

/// Python's `str()` of a template value, appended to `out`.
pub(super) fn py_str(value: &Value, out: &mut String, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::String => {
            out.push_str(value.as_str().unwrap_or_default());
            Ok(())
        }
        _ => py_repr(value, out, depth),
    }
}

/// Python's `repr()` of a template value, appended to `out`.
fn py_repr(value: &Value, out: &mut String, depth: usize) -> Result<(), Error> {
    if depth > VALUE_DEPTH_MAX {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                out.push_str(&py_float_repr(
                    f64::try_from(value.clone()).unwrap_or(f64::NAN),
                ));
            }
        }
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out, depth + 1)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, out, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `repr()` of a string: single quotes unless the text holds `'` and no `"`.
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_py_printable(c) => {
                let cp = c as u32;
                let _ = if cp < 0x100 {
                    write!(out, "\\x{cp:02x}")
                } else if cp < 0x10000 {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// An approximation of Python's `str.isprintable` for one character: control, format,
/// separator (but the space), private-use and surrogate characters are not printable.
fn is_py_printable(c: char) -> bool {
    let cp = c as u32;
    if c == ' ' {
        return true;
    }
    if c.is_control() || (c.is_whitespace()) {
        return false;
    }
    !matches!(cp,
        0xAD | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x180E | 0x200B..=0x200F
        | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF | 0xFFF9..=0xFFFB
        | 0xE000..=0xF8FF | 0xF0000..=0x10FFFF | 0xE0001 | 0xE0020..=0xE007F)
}

/// Python's `repr()` of a float (the shortest digits that read back, fixed notation for
/// exponents -4..16, otherwise `d.ddde+XX`).
pub(super) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// How `json.dumps` lays out its output.
pub(super) struct JsonStyle {
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, arguments by position in that order or by name.
fn tojson(state: &State, value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let mut slots: [Option<Value>; 4] = Default::default();
    if args.len() > slots.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    for (slot, arg) in slots.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (i, name) in ["ensure_ascii", "indent", "separators", "sort_keys"]
        .iter()
        .enumerate()
    {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let truthy = |v: &Option<Value>| v.as_ref().is_some_and(|v| v.is_true());
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(match v.kind() {
            ValueKind::String => v.as_str().unwrap_or_default().to_string(),
            ValueKind::Bool => " ".repeat(usize::from(v.is_true())),
            _ => {
                let n = v.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson indent must be an int or str",
                    )
                })?;
                " ".repeat(n.clamp(0, 64) as usize)
            }
        }),
    };
    let (item_separator, key_separator) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_separator,
        key_separator,
        sort_keys: truthy(&sort_keys),
        ensure_ascii: truthy(&ensure_ascii),
    };
    let mut out = String::new();
    py_json(&value, &style, 0, &mut out)?;
    state.consume_fuel(out.len() as u64 / 64 + 1)?;
    Ok(out)
}

/// Python's `json.dumps` of a template value, appended to `out`.
pub(super) fn py_json(
    value: &Value,
    style: &JsonStyle,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    if level > VALUE_DEPTH_MAX {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "value nested too deeply for tojson",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float_repr(f));
                }
            }
        }
        ValueKind::String => json_string(value.as_str().unwrap_or_default(), style, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, level + 1);
                py_json(item, style, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, level + 1);
                json_string(key, style, out);
                out.push_str(&style.key_separator);
                py_json(item, style, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "Object of type Undefined is not JSON serializable",
            ))
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ))
        }
    }
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers, booleans and None
/// converted; anything else is refused.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(key.clone()).unwrap_or(f64::NAN)),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ))
        }
    })
}

/// A JSON string as Python's encoder writes it (lowercase `\u` escapes; with `ensure_ascii`
/// everything outside printable ASCII is escaped, with surrogate pairs above U+FFFF).
fn json_string(s: &str, style: &JsonStyle, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if style.ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` block tags to `{% if true %}`
/// / `{% endif %}`, keeping their whitespace-control markers.
pub(super) fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match parse_keyword_tag(tag, &["generation", "endgeneration"]) {
            Some((len, keyword, open_marker, close_marker)) => {
                let body = if keyword == "generation" {
                    "if true"
                } else {
                    "endif"
                };
                let _ = write!(out, "{{%{open_marker} {body} {close_marker}%}}");
                rest = &rest[start + len..];
            }
            None => {
                out.push_str("{%");
                rest = &rest[start + 2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Parses `{%[-+]? KEYWORD [-+]?%}` at the start of `tag` for one of `keywords`; returns the
/// tag's length, the keyword and the two whitespace markers.
fn parse_keyword_tag<'k>(
    tag: &str,
    keywords: &[&'k str],
) -> Option<(usize, &'k str, &'static str, &'static str)> {
    let mut i = 2;
    let bytes = tag.as_bytes();
    let marker = |b: Option<&u8>| match b {
        Some(b'-') => "-",
        Some(b'+') => "+",
        _ => "",
    };
    let open = marker(bytes.get(i));
    i += open.len();
    while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i += 1;
    }
    let word_len = bytes[i..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
        .count();
    let word = &tag[i..i + word_len];
    let keyword = *keywords.iter().find(|k| **k == word)?;
    i += word_len;
    while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i += 1;
    }
    let close = marker(bytes.get(i));
    i += close.len();
    if tag.get(i..i + 2) != Some("%}") {
        return None;
    }
    Some((i + 2, keyword, open, close))
}
