//! The house's floors hold: no file of `src/`, of the tests or of a benchmark imports, through
//! a chain of others, a file that imports it back. A circle means a piece two files share lives in one of
//! them (HOUSE.md): give it a home below both instead.
//!
//! The graph: a file is a module; a path that starts at `crate::`, `super::` or `self::` is an
//! edge to the file of the longest module prefix it names, whether a `use` tree holds it or
//! code calls through it (`crate::figures::secs(..)` is as much an import as a `use` line, and
//! a circle made of such calls hid here once). Comments and string literals are not code.
//! A re-export counts where it is written. A folder's `mod.rs` declaring its children is not
//! an edge: a child may use what its folder defines, as the backends use `election`'s traits.
//! The crate, the integration tests and each benchmark folder are checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every `.rs` file below `dir`, by the module it is under `prefix`.
fn modules(dir: &Path, prefix: &[String], found: &mut BTreeMap<Module, PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_stem()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        let mut module = prefix.to_vec();
        if path.is_dir() {
            module.push(name);
            modules(&path, &module, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            if !matches!(name.as_str(), "mod" | "lib" | "main") {
                module.push(name);
            }
            found.insert(module, path);
        }
    }
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else {
        return vec![tree.to_owned()];
    };
    let (prefix, body) = (&tree[..open], &tree[open + 1..tree.len() - 1]);
    let (mut items, mut depth, mut start) = (Vec::new(), 0, 0);
    for (at, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&body[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&body[start..]);
    items
        .into_iter()
        .filter(|item| !item.is_empty())
        .flat_map(|item| expand(&format!("{prefix}{item}")))
        .collect()
}

/// `text` with its comments, string and character literals blanked out (newlines kept), so
/// that a path in a doc comment or a message is not read as an import.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut at = 0;
    while at < chars.len() {
        let c = chars[at];
        let next = chars.get(at + 1).copied();
        let ident_before = at > 0 && (chars[at - 1].is_alphanumeric() || chars[at - 1] == '_');
        if c == '/' && next == Some('/') {
            while at < chars.len() && chars[at] != '\n' {
                at += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while at < chars.len() {
                if chars[at] == '/' && chars.get(at + 1) == Some(&'*') {
                    depth += 1;
                    at += 2;
                } else if chars[at] == '*' && chars.get(at + 1) == Some(&'/') {
                    depth -= 1;
                    at += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[at]);
                    at += 1;
                }
            }
        } else if !ident_before && (c == 'r' || (c == 'b' && next == Some('r'))) && {
            // A raw string: r"..", r#".."#, br"..".
            let mut look = at + if c == 'b' { 2 } else { 1 };
            while chars.get(look) == Some(&'#') {
                look += 1;
            }
            chars.get(look) == Some(&'"')
        } {
            at += if c == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while chars[at] == '#' {
                hashes += 1;
                at += 1;
            }
            at += 1;
            while at < chars.len() {
                if chars[at] == '"' && (1..=hashes).all(|h| chars.get(at + h) == Some(&'#')) {
                    at += 1 + hashes;
                    break;
                }
                blank(&mut out, chars[at]);
                at += 1;
            }
        } else if c == '"' {
            at += 1;
            while at < chars.len() && chars[at] != '"' {
                if chars[at] == '\\' {
                    at += 1;
                }
                if let Some(&c) = chars.get(at) {
                    blank(&mut out, c);
                }
                at += 1;
            }
            at += 1;
        } else if c == '\'' && (next == Some('\\') || chars.get(at + 2) == Some(&'\'')) {
            // A character literal; a lifetime ('a) has no closing quote.
            at += 2;
            while at < chars.len() && chars[at] != '\'' {
                at += 1;
            }
            at += 1;
        } else {
            out.push(c);
            at += 1;
        }
    }
    out
}

/// The file a path names from `inside` (the module the path is written in, inline modules
/// included): the longest module prefix of it that is a file. None for a path that does not
/// start at `crate`, `self` or `super`.
fn target_of(path: &str, inside: &Module, files: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let mut segments: Vec<&str> = path.split("::").collect();
    let mut base: Module = match segments.first().copied() {
        Some("crate") => Vec::new(),
        Some("self") => inside.clone(),
        Some("super") => {
            let mut parent = inside.clone();
            while segments.get(1) == Some(&"super") {
                parent.pop();
                segments.remove(0);
            }
            parent.pop();
            parent
        }
        _ => return None,
    };
    segments.remove(0);
    let mut target = (0..=base.len())
        .rev()
        .map(|len| base[..len].to_vec())
        .find(|prefix| files.contains_key(prefix))
        .unwrap_or_default();
    for segment in segments {
        base.push(segment.split(" as ").next().unwrap_or(segment).to_owned());
        if files.contains_key(&base) {
            target = base.clone();
        }
    }
    Some(target)
}

/// The files `module` (its source is `text`) imports: through `use` trees and through paths
/// that start at `crate::`, `self::` or `super::` anywhere in its code (`crate::a::f()`), but
/// not in its comments or string literals.
fn imports(module: &Module, text: &str, files: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let code = code_only(text);
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let word_at = |at: usize, word: &str| {
        code[at..].starts_with(word)
            && (at == 0 || !(is_ident(bytes[at - 1]) || bytes[at - 1] == b'$'))
            && bytes.get(at + word.len()).is_none_or(|&b| !is_ident(b))
    };
    let mut targets = BTreeSet::new();
    // Inline modules (`mod tests { .. }`) by the brace depth they close at: `super::` inside
    // one is the file itself.
    let (mut inline, mut depth): (Vec<(String, usize)>, usize) = (Vec::new(), 0);
    let mut at = 0;
    while at < bytes.len() {
        let inside = || {
            let mut inside = module.clone();
            inside.extend(inline.iter().map(|(name, _)| name.clone()));
            inside
        };
        match bytes[at] {
            b'{' => depth += 1,
            b'}' => {
                if inline
                    .last()
                    .is_some_and(|(_, at_depth)| *at_depth == depth)
                {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ if word_at(at, "mod") => {
                let rest = &code[at + 3..];
                let name: String = rest
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let after = rest.trim_start()[name.len()..].trim_start();
                if !name.is_empty() && after.starts_with('{') {
                    inline.push((name, depth + 1));
                }
            }
            _ if word_at(at, "use") => {
                let end = code[at..].find(';').map_or(code.len(), |end| at + end);
                // Spaces go, but for those of `x as y`.
                let words: Vec<&str> = code[at + 3..end].split_whitespace().collect();
                let tree = words
                    .join(" ")
                    .replace(" as ", "\u{0}")
                    .replace(' ', "")
                    .replace('\u{0}', " as ");
                let inside = inside();
                targets.extend(
                    expand(&tree)
                        .iter()
                        .filter_map(|path| target_of(path, &inside, files)),
                );
                at = end;
                continue;
            }
            _ if ["crate", "self", "super"]
                .iter()
                .any(|word| word_at(at, word) && code[at + word.len()..].starts_with("::")) =>
            {
                let mut end = at;
                loop {
                    while end < bytes.len() && is_ident(bytes[end]) {
                        end += 1;
                    }
                    let more = code[end..].starts_with("::")
                        && bytes.get(end + 2).is_some_and(|&b| is_ident(b));
                    if !more {
                        break;
                    }
                    end += 2;
                }
                targets.extend(target_of(&code[at..end], &inside(), files));
                at = end;
                continue;
            }
            _ => {}
        }
        at += 1;
    }
    targets.remove(module);
    targets
}

/// A circle in `graph`, if any, as the files along it.
fn circle(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Option<Vec<Module>> {
    fn visit(
        node: &Module,
        graph: &BTreeMap<Module, BTreeSet<Module>>,
        path: &mut Vec<Module>,
        done: &mut BTreeSet<Module>,
    ) -> Option<Vec<Module>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            return Some(path[at..].to_vec());
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

fn assert_no_circle(root: &Path, extra: &[(&str, &Path)]) {
    let mut files = BTreeMap::new();
    modules(root, &[], &mut files);
    for (name, dir) in extra {
        modules(dir, &[name.to_string()], &mut files);
    }
    let graph: BTreeMap<Module, BTreeSet<Module>> = files
        .iter()
        .map(|(module, path)| {
            let text = std::fs::read_to_string(path).expect("a source file");
            (module.clone(), imports(module, &text, &files))
        })
        .collect();
    assert!(
        graph.len() > 5,
        "no source files found below {}",
        root.display()
    );
    // Every circle, not just the first: each found one is cut at its closing edge and the
    // search goes on, so one run lists all that needs a new home.
    let mut graph = graph;
    let mut found = Vec::new();
    while let Some(circle) = circle(&graph) {
        let names: Vec<String> = circle
            .iter()
            .map(|m| {
                if m.is_empty() {
                    "crate".into()
                } else {
                    m.join("::")
                }
            })
            .collect();
        found.push(format!("{} -> {}", names.join(" -> "), names[0]));
        let last = circle.last().expect("a circle has files");
        graph
            .get_mut(last)
            .expect("a file of the graph")
            .remove(&circle[0]);
    }
    assert!(
        found.is_empty(),
        "import circles in {}:\n{}",
        root.display(),
        found.join("\n")
    );
}

#[test]
fn no_file_of_the_crate_imports_itself_through_others() {
    assert_no_circle(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[]);
}

#[test]
fn no_file_of_the_tests_imports_itself_through_others() {
    assert_no_circle(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration"),
        &[],
    );
}

/// Each benchmark under benches/ that is a folder, with the modules its `main.rs` takes in
/// from elsewhere by `#[path = ".."] mod name;` (the failover benchmark takes the tests'
/// harness in as its `harness` module).
#[test]
fn no_file_of_a_benchmark_imports_itself_through_others() {
    let benches = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches");
    let mut seen = 0;
    for entry in std::fs::read_dir(&benches).expect("benches/") {
        let dir = entry.expect("a directory entry").path();
        let Ok(main) = std::fs::read_to_string(dir.join("main.rs")) else {
            continue;
        };
        let mut taken_in = Vec::new();
        let attribute = "#[path = \"";
        for (at, _) in main.match_indices(attribute) {
            let rest = &main[at + attribute.len()..];
            let file = &rest[..rest.find('"').expect("a closing quote")];
            let name = rest
                .split_once("mod ")
                .and_then(|(_, after)| after.split(';').next())
                .expect("a `mod name;` after #[path]");
            let file = dir.join(file);
            let folder = file.parent().expect("a folder").to_path_buf();
            taken_in.push((name.trim().to_owned(), folder));
        }
        let taken_in: Vec<(&str, &Path)> = taken_in
            .iter()
            .map(|(name, folder)| (name.as_str(), folder.as_path()))
            .collect();
        assert_no_circle(&dir, &taken_in);
        seen += 1;
    }
    assert!(seen > 0, "no benchmark folder in {}", benches.display());
}

#[test]
fn a_circle_is_found() {
    let module = |name: &str| vec![name.to_owned()];
    let files: BTreeMap<Module, PathBuf> = ["a", "b"]
        .into_iter()
        .map(|name| (module(name), PathBuf::from(name)))
        .collect();
    let a = imports(
        &module("a"),
        "use crate::b::{Thing, other::{X, Y}};",
        &files,
    );
    let b = imports(&module("b"), "use super::a::Thing as Other;", &files);
    assert_eq!(a, BTreeSet::from([module("b")]));
    assert_eq!(b, BTreeSet::from([module("a")]));
    let graph = BTreeMap::from([(module("a"), a), (module("b"), b)]);
    assert_eq!(circle(&graph), Some(vec![module("a"), module("b")]));
}

/// A path written in code is an edge as a `use` is; one in a comment, a string or a char is
/// not, and `super` inside an inline module is the file itself.
#[test]
fn a_path_in_code_is_an_edge_and_one_in_a_comment_or_string_is_not() {
    let module = |name: &str| vec![name.to_owned()];
    let files: BTreeMap<Module, PathBuf> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|name| (module(name), PathBuf::from(name)))
        .collect();
    let text = r##"
        //! See [`crate::c::Thing`].
        /* crate::c::x() /* nested */ crate::c::y() */
        fn f<'a>(x: &'a str) -> char {
            let _ = "crate::c::z()";
            let _ = r#"crate::c::"quoted""#;
            let _ = '"'; let _ = '\''; let _ = b'{';
            crate::b::run(x);
            Self::new(); $crate::c::w();
            'x'
        }
        mod tests {
            use super::*;
            fn g() { super::f(""); crate::d::Helper::new(); }
        }
    "##;
    assert_eq!(
        imports(&module("a"), text, &files),
        BTreeSet::from([module("b"), module("d")])
    );
}
