/*
 * font.h -- the 5x7 bitmap font of the labels of `mha viz --png`.
 */
#ifndef MHA_TOOL_FONT_H
#define MHA_TOOL_FONT_H

/*
 * Printable ASCII: the bits of row `row` (0 = top .. 6) of character c,
 * bit 4 the leftmost of 5 columns.  Characters outside ' '..'~' are drawn
 * as '?'.
 */
unsigned tool_glyph_row(int c, int row);

#endif
