//! The committed manual page and shell completions match the command-line definitions.
//! `PGLEADER_UPDATE_DOCS=1 cargo test --test integration docs` rewrites them.

use std::path::Path;

fn check(path: &Path, expected: &str, stale: &mut Vec<String>) {
    if std::env::var_os("PGLEADER_UPDATE_DOCS").is_some() {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("create the directory");
        std::fs::write(path, expected).expect("write");
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed != expected {
        stale.push(path.display().to_string());
    }
}

#[test]
fn the_committed_manual_page_and_completions_are_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stale = Vec::new();
    check(
        &root.join("man/pgleader.1"),
        &pgleader::operate::docs::man_page(),
        &mut stale,
    );
    for (name, contents) in pgleader::operate::docs::completions() {
        check(&root.join("completions").join(name), &contents, &mut stale);
    }
    assert!(
        stale.is_empty(),
        "stale generated files: {stale:?}; run `PGLEADER_UPDATE_DOCS=1 cargo test --test integration docs` and commit them"
    );
}
