//! The house's floors hold: no file of `src/` or of the benchmark imports, through a chain of
//! others, a file that imports it back. A circle means a piece two files share lives in one of
//! them (HOUSE.md): give it a home below both instead.
//!
//! The graph: a file is a module; a `use crate::..`, `use super::..` or `use self::..` path is an
//! edge to the file of the longest module prefix it names (a re-export counts where it is
//! written). A folder's `mod.rs` declaring its children is not an edge: a child may use what its
//! folder defines, as the backends use `election`'s traits.

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

/// The files `module` (its source is `text`) imports.
fn imports(module: &Module, text: &str, files: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let mut targets = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| !c.is_whitespace()) {
            continue;
        }
        let end = rest.find(';').unwrap_or(rest.len());
        // Spaces go, but for those of `x as y`.
        let words: Vec<&str> = rest[..end].split_whitespace().collect();
        let tree = words
            .join(" ")
            .replace(" as ", "\u{0}")
            .replace(' ', "")
            .replace('\u{0}', " as ");
        for path in expand(&tree) {
            let mut segments: Vec<&str> = path.split("::").collect();
            let mut base: Module = match segments.first().copied() {
                Some("crate") => Vec::new(),
                Some("self") => module.clone(),
                Some("super") => {
                    // A folder's module is its mod.rs, so `super` is the enclosing module for
                    // a mod.rs and for a plain file alike.
                    let mut parent = module.clone();
                    while segments.get(1) == Some(&"super") {
                        parent.pop();
                        segments.remove(0);
                    }
                    parent.pop();
                    parent
                }
                _ => continue,
            };
            segments.remove(0);
            let mut target = None;
            for segment in segments {
                base.push(segment.split(" as ").next().unwrap_or(segment).to_owned());
                if files.contains_key(&base) {
                    target = Some(base.clone());
                }
            }
            let target = target.unwrap_or_default();
            if &target != module {
                targets.insert(target);
            }
        }
    }
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
    if let Some(circle) = circle(&graph) {
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
        panic!(
            "an import circle in {}: {} -> {}",
            root.display(),
            names.join(" -> "),
            names[0]
        );
    }
}

#[test]
fn no_file_of_the_crate_imports_itself_through_others() {
    assert_no_circle(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[]);
}

#[test]
fn no_file_of_the_benchmark_imports_itself_through_others() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The benchmark takes the tests' harness in as its `harness` module.
    assert_no_circle(
        &root.join("benches/failover"),
        &[("harness", &root.join("tests/integration/harness"))],
    );
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
