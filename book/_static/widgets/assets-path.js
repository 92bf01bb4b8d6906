// Where embed-amd.js finds its font files: next to this script. (Its own guess, from the module
// URL's origin, is "null" for a book opened from file://.)
window.__jupyter_widgets_assets_path__ = document.currentScript.src.replace(/[^/]*$/, "");
