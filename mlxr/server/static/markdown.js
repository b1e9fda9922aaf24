// A small markdown renderer for model answers: fenced code blocks, inline code, headings,
// bold/italic, lists, block quotes, http(s) links and paragraphs.
// Hand-written, not a library: the page ships without dependencies and works offline (no CDN,
// no build step), and this is the whole subset chat answers use.
// Model output is hostile input: every piece of text is HTML-escaped FIRST, and the only markup
// in the result is the fixed set of tags added below (links: http(s) URLs only, no attributes
// from the text other than the escaped href).
"use strict";

(function () {
  function escapeHtml(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // inline markup of one escaped line: code spans first (their content is left as is)
  function inline(escaped) {
    const parts = escaped.split(/(`[^`]+`)/g);
    return parts.map(function (p) {
      if (p.length > 2 && p[0] === "`" && p[p.length - 1] === "`") {
        return "<code>" + p.slice(1, -1) + "</code>";
      }
      return p
        .replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g,
          '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
        .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
    }).join("");
  }

  function renderBlocks(text) {
    const out = [];
    let para = [], list = null;
    function flushPara() {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    }
    function flushList() {
      if (list) out.push("<" + list.tag + ">" + list.items.map(function (i) {
        return "<li>" + inline(i) + "</li>";
      }).join("") + "</" + list.tag + ">");
      list = null;
    }
    escapeHtml(text).split("\n").forEach(function (line) {
      let m;
      if (!line.trim()) { flushPara(); flushList(); return; }
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flushPara(); flushList();
        const n = m[1].length;
        out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">");
      } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
        flushPara();
        const tag = /^\s*\d/.test(line) ? "ol" : "ul";
        if (!list || list.tag !== tag) { flushList(); list = { tag: tag, items: [] }; }
        list.items.push(m[1]);
      } else if ((m = /^&gt;\s?(.*)$/.exec(line))) {
        flushPara(); flushList();
        out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
      } else {
        flushList();
        para.push(line);
      }
    });
    flushPara(); flushList();
    return out.join("");
  }

  // text -> HTML: fenced blocks (``` lang ... ```, an unclosed one runs to the end, as it
  // does while streaming) as <pre><code>, the rest as blocks
  function render(text) {
    const out = [];
    const re = /```([\w+-]*)[^\n]*\n?([\s\S]*?)(```|$)/g;
    let last = 0, m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) out.push(renderBlocks(text.slice(last, m.index)));
      const lang = m[1] ? ' class="language-' + escapeHtml(m[1]) + '"' : "";
      out.push("<pre><code" + lang + ">" + escapeHtml(m[2].replace(/\n$/, "")) + "</code></pre>");
      last = re.lastIndex;
      if (m[0].length === 0) break;
    }
    if (last < text.length) out.push(renderBlocks(text.slice(last)));
    return out.join("");
  }

  window.mlxrMarkdown = { render: render, escapeHtml: escapeHtml };
})();
