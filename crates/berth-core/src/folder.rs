//! The working folder a launch asks for: relative to the user's
//! workspace, and never outside it.

use std::path::{Component, Path};

/// Validates a requested folder (relative to the workspace) and returns its
/// normalised form: `""` for the workspace root, else `a/b` without `.`
/// components. Absolute paths and `..` are refused so that an instance can
/// never start outside its user's workspace.
pub fn normalize_folder(folder: Option<&str>) -> Result<String, String> {
    let Some(raw) = folder else {
        return Ok(String::new());
    };
    if raw.contains('\0') {
        return Err("folder contains a NUL byte".into());
    }
    let path = Path::new(raw);
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => match part.to_str() {
                Some(s) => parts.push(s),
                None => return Err("folder is not valid UTF-8".into()),
            },
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!("folder {raw:?} must be relative to the workspace"));
            }
            Component::ParentDir => {
                return Err(format!("folder {raw:?} must not contain '..'"));
            }
        }
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_stay_inside_the_workspace() {
        assert_eq!(normalize_folder(None).unwrap(), "");
        assert_eq!(normalize_folder(Some("")).unwrap(), "");
        assert_eq!(normalize_folder(Some(".")).unwrap(), "");
        assert_eq!(normalize_folder(Some("a/./b/")).unwrap(), "a/b");
        assert_eq!(normalize_folder(Some("proj x")).unwrap(), "proj x");
        for bad in ["/etc", "..", "a/../../b", "a/..", "a\0b"] {
            assert!(normalize_folder(Some(bad)).is_err(), "{bad:?}");
        }
    }
}
